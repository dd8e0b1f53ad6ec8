//! Peer timings from peers/torch_peers.py, matched to our cases.

use std::collections::HashSet;
use std::path::Path;

use crate::cases::Case;
use crate::error::{io_error, Error, Result};
use crate::record::{PeerComparison, PeerRecord};

/// Reads a peer JSON file: a list of records (or one record).
///
/// # Errors
/// When the file cannot be read or is not peer JSON.
pub fn read_peers(path: &Path) -> Result<Vec<PeerRecord>> {
    let text = std::fs::read_to_string(path).map_err(|e| io_error("read", path, e))?;
    let value: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| Error::new(format!("{}: not JSON: {e}", path.display())))?;
    let list = match value {
        serde_json::Value::Array(list) => list,
        one @ serde_json::Value::Object(_) => vec![one],
        _ => {
            return Err(Error::new(format!(
                "{}: expected a list of peer records",
                path.display()
            )))
        }
    };
    list.into_iter()
        .enumerate()
        .map(|(i, v)| {
            serde_json::from_value(v).map_err(|e| {
                Error::new(format!(
                    "{}: record {i} is not a peer record: {e}",
                    path.display()
                ))
            })
        })
        .collect()
}

/// The peer records of a run, looked up by graph and shape.
#[derive(Clone, Debug, Default)]
pub struct Peers {
    records: Vec<PeerRecord>,
}

impl Peers {
    /// Wraps records (later records of the same peer and configuration win).
    pub fn new(records: Vec<PeerRecord>) -> Self {
        Peers { records }
    }

    /// All records.
    pub fn records(&self) -> &[PeerRecord] {
        &self.records
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.records.is_empty()
    }

    /// The peer names present, sorted.
    pub fn names(&self) -> Vec<String> {
        let set: HashSet<&str> = self.records.iter().map(|r| r.peer.as_str()).collect();
        let mut names: Vec<String> = set.into_iter().map(str::to_string).collect();
        names.sort();
        names
    }

    /// The record of `peer` on this graph and configuration, if any (the last one given).
    pub fn find(
        &self,
        peer: &str,
        graph: &str,
        heads: u32,
        head_dim: u32,
        dtype: &str,
    ) -> Option<&PeerRecord> {
        self.records.iter().rev().find(|r| {
            r.peer == peer
                && r.graph == graph
                && r.heads == heads
                && r.head_dim == head_dim
                && r.dtype == dtype
        })
    }

    /// Graph names whose peer records have another nnz than `nnz` (the peers saw another
    /// graph: e.g. not symmetrized); such records are not compared.
    pub fn nnz_mismatch(&self, graph: &str, nnz: u64) -> Option<u64> {
        self.records
            .iter()
            .find(|r| r.graph == graph && r.nnz != nnz)
            .map(|r| r.nnz)
    }

    /// The comparisons of `case` on this configuration, with ratios to `our_ms`.
    #[allow(clippy::too_many_arguments)]
    pub fn compare(
        &self,
        case: &Case,
        graph: &str,
        nnz: u64,
        heads: u32,
        head_dim: u32,
        dtype: &str,
        our_ms: Option<f64>,
    ) -> Vec<PeerComparison> {
        case.peers
            .iter()
            .filter_map(|peer| self.find(peer, graph, heads, head_dim, dtype))
            .filter(|r| r.nnz == nnz)
            .map(|r| r.compared_with(our_ms))
            .collect()
    }
}

impl PeerRecord {
    /// This record next to one of our cases timed `our_ms`: the ratio (peer / ours) where the
    /// peer ran; its error, status and form either way.
    pub fn compared_with(&self, our_ms: Option<f64>) -> PeerComparison {
        let ratio = match (self.ran(), self.median_ms, our_ms) {
            (true, Some(peer), Some(ours)) if ours > 0.0 => Some(peer / ours),
            _ => None,
        };
        PeerComparison {
            peer: self.peer.clone(),
            median_ms: self.median_ms,
            dtype_used: self
                .dtype_used
                .clone()
                .unwrap_or_else(|| self.dtype.clone()),
            ratio,
            rel_err: self.rel_err,
            ok: self.ok,
            status: self.status.clone(),
            reason: self.reason.clone(),
            variant: self.variant.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(peer: &str, graph: &str, nnz: u64, ms: f64) -> PeerRecord {
        PeerRecord {
            graph: graph.into(),
            n: 10,
            nnz,
            heads: 1,
            head_dim: 64,
            dtype: "f16".into(),
            peer: peer.into(),
            median_ms: Some(ms),
            dtype_used: None,
            note: None,
            gpu: None,
            torch: None,
            status: "ok".into(),
            reason: None,
            variant: None,
            rel_err: None,
            tolerance: None,
            ok: None,
        }
    }

    #[test]
    fn matching() {
        let peers = Peers::new(vec![
            rec("torch_sparse_attention", "cora", 100, 2.0),
            rec("cusparse_spmm", "cora", 100, 1.0),
            rec("torch_sparse_attention", "cora", 100, 3.0),
            rec("pyg_attention", "cora", 99, 5.0),
        ]);
        let case = crate::cases::find("unfused-csr").unwrap();
        let c = peers.compare(case, "cora", 100, 1, 64, "f16", Some(0.5));
        assert_eq!(c.len(), 1); // pyg saw another graph; cusparse_spmm is not an attention peer
        assert_eq!(
            (c[0].peer.as_str(), c[0].ratio),
            ("torch_sparse_attention", Some(6.0))
        );
        assert_eq!(c[0].dtype_used, "f16");
        assert_eq!(peers.nnz_mismatch("cora", 100), Some(99));
        assert_eq!(
            peers.names(),
            ["cusparse_spmm", "pyg_attention", "torch_sparse_attention"]
        );
    }

    #[test]
    fn reads_the_script_output() {
        let dir = std::env::temp_dir().join(format!("spattn-bench-peers-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("p.json");
        std::fs::write(
            &path,
            r#"[{"graph": "cora", "n": 2708, "nnz": 13264, "heads": 1, "head_dim": 64,
                "dtype": "f16", "peer": "cusparse_spmm", "median_ms": 0.05, "dtype_used": "f32",
                "note": "", "gpu": "NVIDIA H100", "torch": "2.11.0", "extra": 1}]"#,
        )
        .unwrap();
        let r = read_peers(&path).unwrap();
        assert_eq!(r[0].dtype_used.as_deref(), Some("f32"));
        std::fs::write(&path, "[1]").unwrap();
        assert!(read_peers(&path)
            .unwrap_err()
            .to_string()
            .contains("record 0"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
