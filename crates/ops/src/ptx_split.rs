//! One kernel's PTX cut out of its module's, so that the driver JIT-compiles only the kernels a
//! plan launches.
//!
//! The driver compiles a PTX module whole when it is loaded: `fused_bsb.ptx` (dozens of kernels,
//! megabytes) takes ptxas seconds of one core, `hybrid.ptx` longer, while a plan launches a few
//! of them. The piece of a kernel is the module's text with every other `.entry` removed: the
//! header, the module-scope declarations (dynamic shared memory; with `cargo xtask ptx
//! --lineinfo`, `.file` lines and debug strings) and that one entry, byte for byte. ptxas compiles each entry on its
//! own, so the machine code is the same as the whole module's.
//!
//! A module is returned whole where cutting could change what it does or where its text is not
//! understood: module-scope `.global` or `.const` variables (kernels could share them), or
//! braces that do not balance.

use std::borrow::Cow;

/// The byte range of one `.entry` (from its line's start to the end of the line that closes its
/// body) and its name.
#[derive(Debug, PartialEq, Eq)]
struct Entry<'a> {
    name: &'a str,
    start: usize,
    end: usize,
}

/// How a module's text splits: its entries, or `None` where it must be loaded whole.
fn entries(module: &str) -> Option<Vec<Entry<'_>>> {
    let mut out = Vec::new();
    let mut depth = 0usize;
    // The entry being read: its name, first byte and whether its body has opened.
    let mut open: Option<(&str, usize, bool)> = None;
    let mut at = 0usize;
    for line in module.split_inclusive('\n') {
        let start = at;
        at += line.len();
        let code = line.split("//").next().unwrap_or("").trim();
        if depth == 0 && open.is_none() {
            let mut words = code.split_whitespace();
            let first = words.next().unwrap_or("");
            let words: Vec<&str> = std::iter::once(first).chain(words.take(2)).collect();
            if words.iter().any(|w| *w == ".global" || *w == ".const") {
                return None;
            }
            if let Some(i) = words.iter().position(|w| *w == ".entry") {
                // `.visible .entry name(` or `.entry name (`: the name ends at '(' or a space.
                let rest = code.split(".entry").nth(1).unwrap_or("").trim_start();
                let name = rest.split(['(', ' ', '\t']).next().unwrap_or("");
                if name.is_empty() || i > 1 {
                    return None;
                }
                open = Some((name, start, false));
            }
        }
        for c in code.chars() {
            match c {
                '{' => {
                    depth += 1;
                    if let Some(o) = open.as_mut() {
                        o.2 = true;
                    }
                }
                '}' => depth = depth.checked_sub(1)?,
                _ => {}
            }
        }
        if let Some((name, begin, true)) = open {
            if depth == 0 {
                out.push(Entry {
                    name,
                    start: begin,
                    end: at,
                });
                open = None;
            }
        }
    }
    (depth == 0 && open.is_none()).then_some(out)
}

/// Where a module's entries are: found by one scan of its text (tens of milliseconds for the
/// largest modules) and reused for each of its kernels.
#[derive(Debug, Default)]
pub(crate) struct Index {
    /// The text it was made of (address and length), so that another text is not cut by it.
    text: (usize, usize),
    /// Each entry's name and byte range; `None` where the module is loaded whole (state at
    /// module scope, braces that do not balance, or no entries at all).
    entries: Option<Vec<(String, usize, usize)>>,
}

impl Index {
    /// The index of `module`'s text.
    pub(crate) fn of(module: &str) -> Self {
        Self {
            text: (module.as_ptr() as usize, module.len()),
            entries: entries(module).filter(|e| !e.is_empty()).map(|found| {
                found
                    .into_iter()
                    .map(|e| (e.name.to_owned(), e.start, e.end))
                    .collect()
            }),
        }
    }

    /// Whether this is the index of `module` (the same text in the same place).
    pub(crate) fn is_of(&self, module: &str) -> bool {
        self.text == (module.as_ptr() as usize, module.len())
    }

    /// The PTX the driver needs for `kernel` of `module` (the text this index was made of;
    /// another text is indexed afresh):
    /// the module without its other entries, the whole module where it cannot be cut (see the
    /// module's doc) or has no entries, or `None` where no entry of `module` is named `kernel`.
    pub(crate) fn piece<'a>(&self, module: &'a str, kernel: &str) -> Option<Cow<'a, str>> {
        if !self.is_of(module) {
            return Self::of(module).piece(module, kernel);
        }
        // Text without entries is not cut: the driver says what is wrong with it.
        let Some(entries) = &self.entries else {
            return Some(Cow::Borrowed(module));
        };
        if !entries.iter().any(|e| e.0 == kernel) {
            return None;
        }
        if entries.len() == 1 {
            return Some(Cow::Borrowed(module));
        }
        let others = || entries.iter().filter(|e| e.0 != kernel);
        let removed: usize = others().map(|e| e.2 - e.1).sum();
        let mut piece = String::with_capacity(module.len() - removed);
        let mut at = 0;
        for (_, start, end) in others() {
            piece.push_str(&module[at..*start]);
            at = *end;
        }
        piece.push_str(&module[at..]);
        Some(Cow::Owned(piece))
    }
}

/// [`Index::piece`] of a module indexed for this one call.
#[cfg(test)]
fn kernel_ptx<'a>(module: &'a str, kernel: &str) -> Option<Cow<'a, str>> {
    Index::of(module).piece(module, kernel)
}

#[cfg(test)]
mod tests {
    use super::*;
    use spattn_kernels_sys::MODULES;

    const TWO: &str = "//\n.version 8.4\n.target sm_80\n.address_size 64\n\n\
        .extern .shared .align 16 .b8 smem[];\n\n\
        .visible .entry a(\n\t.param .u64 a_p\n)\n.maxntid 256, 1, 1\n{\n\t{ // inner }\n\t}\n\tret;\n}\n\
        // }\n\
        .visible .entry b(\n\t.param .u32 b_p\n)\n{\n\tret;\n}\n\
        \t.file\t1 \"x.cu\"\n\t.section\t.debug_str\n\t{\n$L__info_string0:\n.b8 97,0\n\t}\n";

    #[test]
    fn a_piece_is_its_module_without_the_other_entries() {
        let a = kernel_ptx(TWO, "a").unwrap();
        let b = kernel_ptx(TWO, "b").unwrap();
        assert!(a.contains(".visible .entry a(") && !a.contains(".entry b"));
        assert!(b.contains(".visible .entry b(") && !b.contains(".entry a"));
        for piece in [&a, &b] {
            assert!(piece.starts_with("//\n.version 8.4\n.target sm_80\n"));
            assert!(piece.contains(".extern .shared .align 16 .b8 smem[];"));
            assert!(piece.ends_with(".b8 97,0\n\t}\n"));
        }
        // The inner braces and the brace in a comment neither end nor extend an entry.
        let entry_a = &TWO[TWO.find(".visible .entry a").unwrap()..TWO.find("// }").unwrap()];
        assert!(a.contains(entry_a) && entry_a.ends_with("ret;\n}\n"));
        assert_eq!(a.len() + b.len(), TWO.len() + common_len(TWO));
        assert!(kernel_ptx(TWO, "c").is_none());
        assert!(kernel_ptx(TWO, "").is_none());
    }

    /// The bytes outside every entry.
    fn common_len(module: &str) -> usize {
        module.len()
            - entries(module)
                .unwrap()
                .iter()
                .map(|e| e.end - e.start)
                .sum::<usize>()
    }

    #[test]
    fn one_index_serves_every_kernel_and_another_text_is_indexed_afresh() {
        let index = Index::of(TWO);
        assert!(index.is_of(TWO));
        for k in ["a", "b"] {
            assert_eq!(index.piece(TWO, k), kernel_ptx(TWO, k));
        }
        // The same text elsewhere (or any other text) is not cut by this index.
        let copy = TWO.to_string();
        assert!(!index.is_of(&copy));
        assert_eq!(index.piece(&copy, "b"), kernel_ptx(TWO, "b"));
        let other = TWO.replace("entry b(", "entry bb(");
        assert!(index.piece(&other, "bb").is_some());
        assert!(index.piece(&other, "b").is_none());
    }

    #[test]
    fn modules_with_state_or_unbalanced_braces_stay_whole() {
        let global = TWO.replace(
            ".address_size 64\n",
            ".address_size 64\n.global .u32 counter;\n",
        );
        let constant = TWO.replace(
            ".address_size 64\n",
            ".address_size 64\n.visible .const .align 4 .b8 table[16];\n",
        );
        let unbalanced = TWO.replace("\tret;\n}\n\t.file", "\tret;\n\t.file");
        for m in [&global, &constant, &unbalanced] {
            assert!(
                matches!(kernel_ptx(m, "b"), Some(Cow::Borrowed(whole)) if whole == m.as_str())
            );
        }
        // A one-entry module is its own piece.
        let one = TWO.replace("a(", "only(");
        let only = &one[..one.find(".visible .entry b").unwrap()];
        assert!(matches!(kernel_ptx(only, "only"), Some(Cow::Borrowed(m)) if m == only));
        // Text without entries goes to the driver as it is, to be refused there.
        assert!(matches!(
            kernel_ptx("not PTX", "k"),
            Some(Cow::Borrowed("not PTX"))
        ));
    }

    #[test]
    fn every_shipped_kernel_has_a_piece_with_only_its_entry() {
        for module in MODULES {
            let found = entries(module.ptx).expect("a shipped module cuts into entries");
            let mut names: Vec<&str> = found.iter().map(|e| e.name).collect();
            names.sort_unstable();
            let mut listed = module.kernels.to_vec();
            listed.sort_unstable();
            assert_eq!(names, listed, "{}: entries", module.name);
            let common = common_len(module.ptx);
            for e in &found {
                let piece = kernel_ptx(module.ptx, e.name).unwrap();
                assert_eq!(
                    piece.matches(".entry ").count(),
                    1,
                    "{} {}",
                    module.name,
                    e.name
                );
                assert!(piece.contains(&module.ptx[e.start..e.end]));
                assert_eq!(
                    piece.len(),
                    common + e.end - e.start,
                    "{} {}",
                    module.name,
                    e.name
                );
                let header = &module.ptx[..module.ptx.find(".address_size").unwrap()];
                assert!(piece.starts_with(header));
            }
        }
    }
}
