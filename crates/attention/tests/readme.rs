//! The README's first example compiles as written, importing only `spattn` (its text is
//! compared with the body below, so the two cannot drift apart).

/// The README example, verbatim between the markers; runs where there is a GPU.
#[allow(dead_code)]
fn readme_example() -> Result<(), Box<dyn std::error::Error>> {
    // README-BEGIN
    use spattn::{
        f16, read_matrix_market, AttentionConfig, AttentionPlan, DTypeKind, DeviceMatrix, Gpu,
    };

    let a = read_matrix_market("cora.mtx.gz")?.symmetrize_with_self_loops()?;
    let gpu = Gpu::new(0)?;
    let plan = AttentionPlan::new_gpu(&gpu, &a, AttentionConfig::new(8, 64, DTypeKind::F16))?;
    println!("{}: {}", plan.algorithm(), plan.choice());
    let x = vec![f16::from_f32(0.5); plan.shape_q().len()];
    let q = DeviceMatrix::from_host(&gpu, plan.shape_q(), &x)?; // n × 8 heads × 64, f16
    let (k, v) = (q.try_clone()?, q.try_clone()?);
    let mut out = DeviceMatrix::zeros(&gpu, plan.shape_q())?;
    plan.forward(&q, &k, &v, &mut out)?; // as often as needed; plan.backward(...) for gradients
                                         // README-END
    Ok(())
}

/// The lines of the first ```rust block of README.md and of the body above are the same
/// (indentation aside).
#[test]
fn readme_example_is_this_one() {
    let readme = include_str!("../../../README.md");
    let start = readme.find("```rust\n").expect("a rust block in README.md") + "```rust\n".len();
    let end = start + readme[start..].find("```").expect("the block's end");
    let block: Vec<&str> = readme[start..end]
        .trim_end()
        .lines()
        .map(str::trim)
        .collect();
    let this = include_str!("readme.rs");
    let body = &this[this.find("// README-BEGIN\n").expect("marker") + 16..];
    let body = &body[..body.find("// README-END").expect("marker")];
    let body: Vec<&str> = body.trim_end().lines().map(str::trim).collect();
    assert_eq!(
        block, body,
        "README.md's first example and tests/readme.rs differ"
    );
}

/// With a GPU and the bundled cora at hand, the example runs.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn readme_example_runs() {
    let dir = spattn_test_support::cora_path();
    let dir = dir.parent().expect("cora's folder");
    std::env::set_current_dir(dir).expect("cd to cora's folder");
    readme_example().expect("the README example runs");
}
