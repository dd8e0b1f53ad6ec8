//! Tests of the GPU runtime: `Gpu`, device buffers, `DeviceCsr`, the module cache, the launch
//! plumbing (crate-private, hence a unit-test module) and the timer.
//!
//! The CPU tests run everywhere and check that a machine without a driver gets typed errors,
//! never a panic. The GPU tests are `#[ignore = "needs an NVIDIA GPU"]`; run them with
//! `cargo test -p spattn-ops --lib runtime_tests -- --include-ignored` on a GPU machine.

use crate::launch::{
    blocks_for, check_same_gpu, grid_1d, launch, to_u32, PushKernelArg, MAX_GRID_X,
};
use crate::{DType, DTypeKind, DeviceCsr, DeviceMatrix, DeviceVec, Error, Gpu, GpuTimer, Shape};
use half::{bf16, f16};
use rand::{Rng, SeedableRng};
use rand_pcg::Pcg64;
use spattn_formats::Csr;
use spattn_kernels_sys::PtxModule;

/// Whether libcuda can be loaded here, asked of cudarc directly (not through `Gpu`).
fn driver_present() -> bool {
    // SAFETY: only tries to dlopen libcuda under its usual names; no preconditions.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

// ---------------------------------------------------------------------------------------------
// CPU tests
// ---------------------------------------------------------------------------------------------

#[test]
fn no_driver_gives_typed_errors_not_panics() {
    if driver_present() {
        // A GPU machine: the probe and the constructor must agree.
        assert_eq!(Gpu::is_available(), Gpu::new(0).is_ok());
        return;
    }
    assert!(matches!(Gpu::new(0), Err(Error::NoCudaDriver)));
    assert!(matches!(Gpu::new(usize::MAX), Err(Error::NoCudaDriver)));
    assert!(matches!(Gpu::device_count(), Err(Error::NoCudaDriver)));
    assert!(!Gpu::is_available());
    let message = Gpu::new(0).unwrap_err().to_string();
    assert!(message.contains("libcuda"), "{message}");
}

#[test]
fn handles_and_buffers_are_send_and_sync() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<Gpu>();
    send_sync::<GpuTimer>();
    send_sync::<DeviceCsr>();
    send_sync::<DeviceMatrix<f16>>();
    send_sync::<DeviceVec<u32>>();
    send_sync::<Error>();
}

#[test]
fn sizes_are_narrowed_with_typed_errors() {
    assert_eq!(to_u32("nnz", u32::MAX as usize).unwrap(), u32::MAX);
    match to_u32("nnz", u32::MAX as usize + 1) {
        Err(Error::TooLarge { what, value, limit }) => {
            assert_eq!((what, value, limit), ("nnz", 1 << 32, u32::MAX as u64));
        }
        other => panic!("expected TooLarge, got {other:?}"),
    }
    assert_eq!(blocks_for(0, 128).unwrap(), 0);
    assert_eq!(blocks_for(129, 128).unwrap(), 2);
    assert!(matches!(
        blocks_for(MAX_GRID_X as usize * 256 + 1, 256),
        Err(Error::TooLarge { .. })
    ));
    assert!(matches!(
        blocks_for(1, 0),
        Err(Error::InvalidArgument { .. })
    ));
    assert!(grid_1d(100, 1025).is_err());
    assert_eq!(grid_1d(100, 32).unwrap().grid_dim, (4, 1, 1));
}

#[test]
fn shapes_and_lengths_are_validated() {
    assert!(matches!(
        Shape::new(4, 0, 8),
        Err(Error::InvalidArgument { what: "heads", .. })
    ));
    assert!(matches!(
        Shape::new(4, 2, 0),
        Err(Error::InvalidArgument {
            what: "head_dim",
            ..
        })
    ));
    assert!(Shape::new(usize::MAX, 2, 2).is_err());
    let s = Shape::new(7, 2, 3).unwrap();
    assert_eq!((s.len(), s.row_len()), (42, 6));
    assert!(matches!(
        s.expect_len("Q", 41),
        Err(Error::LengthMismatch {
            what: "Q",
            expected: 42,
            actual: 41
        })
    ));
    let other = Shape::new(7, 3, 2).unwrap();
    assert!(matches!(
        s.expect_eq("K", other),
        Err(Error::ShapeMismatch { what: "K", .. })
    ));
}

#[test]
fn dtype_kinds_parse_and_print() {
    for kind in DTypeKind::ALL {
        assert_eq!(kind.to_string().parse::<DTypeKind>().unwrap(), kind);
    }
    assert_eq!(<f32 as DType>::KIND, DTypeKind::F32);
    assert_eq!(<f16 as DType>::NAME, "f16");
    assert_eq!(<bf16 as DType>::NAME, "bf16");
    assert!("int8".parse::<DTypeKind>().is_err());
}

// ---------------------------------------------------------------------------------------------
// GPU tests
// ---------------------------------------------------------------------------------------------

fn open_gpu() -> Gpu {
    Gpu::new(0).expect("this test needs an NVIDIA GPU (run ignored tests only on one)")
}

/// A hand-written PTX module (ISA 7.0, sm_52: loads on every CUDA 11+ driver), so the cache
/// and launch tests do not depend on the generated kernels.
const TEST_MODULE: &str = "runtime_test";
const TEST_PTX: &str = r#"
.version 7.0
.target sm_52
.address_size 64

.visible .entry runtime_test_noop()
{
	ret;
}

.visible .entry runtime_test_fill_f32(
	.param .u64 p_out,
	.param .u32 p_n,
	.param .f32 p_v
)
{
	.reg .pred 	%p<2>;
	.reg .b32 	%r<6>;
	.reg .f32 	%f<2>;
	.reg .b64 	%rd<5>;

	ld.param.u64 	%rd1, [p_out];
	ld.param.u32 	%r1, [p_n];
	ld.param.f32 	%f1, [p_v];
	mov.u32 	%r2, %ctaid.x;
	mov.u32 	%r3, %ntid.x;
	mov.u32 	%r4, %tid.x;
	mad.lo.s32 	%r5, %r2, %r3, %r4;
	setp.ge.u32 	%p1, %r5, %r1;
	@%p1 bra 	$L_done;
	cvta.to.global.u64 	%rd2, %rd1;
	mul.wide.u32 	%rd3, %r5, 4;
	add.s64 	%rd4, %rd2, %rd3;
	st.global.f32 	[%rd4], %f1;
$L_done:
	ret;
}
"#;

const SHAPES: [(usize, usize, usize); 6] = [
    (0, 1, 1),
    (1, 1, 1),
    (7, 2, 3),
    (17, 8, 24),
    (33, 1, 256),
    (1000, 2, 64),
];

fn random_values<T: DType>(rng: &mut Pcg64, len: usize) -> Vec<T> {
    (0..len)
        .map(|_| T::from_f64(rng.random_range(-4.0..4.0)))
        .collect()
}

fn round_trip<T: DType>(gpu: &Gpu, rng: &mut Pcg64) {
    for (rows, heads, head_dim) in SHAPES {
        let shape = Shape::new(rows, heads, head_dim).unwrap();
        let host = random_values::<T>(rng, shape.len());
        let mut m = DeviceMatrix::from_host(gpu, shape, &host).unwrap();
        assert_eq!(m.shape(), shape);
        assert_eq!(m.len(), shape.len());
        assert_eq!(m.to_host().unwrap(), host, "{} {shape}", T::NAME);

        let copy = m.try_clone().unwrap();
        let other = random_values::<T>(rng, shape.len());
        m.copy_from_host(&other).unwrap();
        let mut back = vec![T::default(); shape.len()];
        m.copy_to_host(&mut back).unwrap();
        assert_eq!(back, other);
        assert_eq!(copy.to_host().unwrap(), host, "the clone is a copy");

        let zeros = DeviceMatrix::<T>::zeros(gpu, shape).unwrap();
        assert!(zeros.to_host().unwrap().iter().all(|x| x.to_f64() == 0.0));
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn upload_download_round_trip_every_dtype() {
    let gpu = open_gpu();
    let mut rng = Pcg64::seed_from_u64(0x5ba7);
    round_trip::<f32>(&gpu, &mut rng);
    round_trip::<f16>(&gpu, &mut rng);
    round_trip::<bf16>(&gpu, &mut rng);
    let idx: Vec<u32> = (0..1001).map(|_| rng.random()).collect();
    let v = DeviceVec::from_host(&gpu, &idx).unwrap();
    assert_eq!(v.to_host().unwrap(), idx);
    assert_eq!(v.num_bytes(), 4004);
}

fn poison<T: DType>(gpu: &Gpu) {
    for (rows, heads, head_dim) in SHAPES {
        let shape = Shape::new(rows, heads, head_dim).unwrap();
        let mut m = DeviceMatrix::<T>::zeros(gpu, shape).unwrap();
        m.fill_nan().unwrap();
        let host = m.to_host().unwrap();
        assert_eq!(host.len(), shape.len());
        let nan = T::nan();
        assert!(
            host.iter()
                .all(|x| bytemuck::bytes_of(x) == bytemuck::bytes_of(&nan)),
            "{} {shape}: not all canonical NaN",
            T::NAME
        );
        let value = T::from_f64(-2.5);
        m.fill(value).unwrap();
        assert!(m.to_host().unwrap().iter().all(|&x| x == value));
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn fill_nan_poisons_every_element() {
    let gpu = open_gpu();
    poison::<f32>(&gpu);
    poison::<f16>(&gpu);
    poison::<bf16>(&gpu);
    // 32-, 8-bit memsets and the upload fallback of a non-repeating 8-byte value.
    let mut scores = DeviceVec::<f32>::zeros(&gpu, 12_345).unwrap();
    scores.fill_nan().unwrap();
    assert!(scores.to_host().unwrap().iter().all(|x| x.is_nan()));
    let mut idx = DeviceVec::<u32>::zeros(&gpu, 7).unwrap();
    idx.fill(0xdead_beef).unwrap();
    assert_eq!(idx.to_host().unwrap(), vec![0xdead_beef; 7]);
    let mut bytes = DeviceVec::<u8>::zeros(&gpu, 5).unwrap();
    bytes.fill(0xa5).unwrap();
    assert_eq!(bytes.to_host().unwrap(), vec![0xa5; 5]);
    let mut wide = DeviceVec::<f64>::zeros(&gpu, 9).unwrap();
    wide.fill(1.0).unwrap();
    assert_eq!(wide.to_host().unwrap(), vec![1.0; 9]);
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn wrong_lengths_are_errors() {
    let gpu = open_gpu();
    let shape = Shape::new(7, 2, 3).unwrap();
    let host = vec![1.0f32; shape.len() - 1];
    assert!(matches!(
        DeviceMatrix::from_host(&gpu, shape, &host),
        Err(Error::LengthMismatch {
            expected: 42,
            actual: 41,
            ..
        })
    ));
    let mut m = DeviceMatrix::<f32>::zeros(&gpu, shape).unwrap();
    assert!(matches!(
        m.copy_from_host(&host),
        Err(Error::LengthMismatch { .. })
    ));
    let mut out = vec![0.0f32; 43];
    assert!(matches!(
        m.copy_to_host(&mut out),
        Err(Error::LengthMismatch { .. })
    ));
    assert!(m.reshape(Shape::new(6, 7, 1).unwrap()).is_ok());
    assert!(m.reshape(Shape::new(6, 7, 2).unwrap()).is_err());
    let v = DeviceVec::<f32>::zeros(&gpu, 10).unwrap();
    assert!(matches!(
        DeviceMatrix::from_vec(v, shape),
        Err(Error::LengthMismatch { .. })
    ));
}

fn random_csr(rng: &mut Pcg64, n: usize, with_values: bool) -> Csr {
    let mut edges = Vec::new();
    for i in 0..n {
        if i % 7 == 3 {
            continue; // empty rows
        }
        let degree = if i == 0 { n } else { rng.random_range(1..6) };
        for _ in 0..degree {
            edges.push((i as u32, rng.random_range(0..n as u32)));
        }
    }
    let csr = Csr::from_edges(n, n, &edges).unwrap();
    if with_values {
        let values = (0..csr.nnz()).map(|_| rng.random()).collect();
        csr.with_values(Some(values)).unwrap()
    } else {
        csr
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn device_csr_round_trip() {
    let gpu = open_gpu();
    let mut rng = Pcg64::seed_from_u64(42);
    let mut cases = vec![
        Csr::empty(0, 0).unwrap(),
        Csr::empty(5, 3).unwrap(),
        Csr::identity(1).unwrap(),
    ];
    for n in [7, 17, 300] {
        cases.push(random_csr(&mut rng, n, false));
        cases.push(random_csr(&mut rng, n, true));
    }
    for csr in &cases {
        let d = DeviceCsr::upload(&gpu, csr).unwrap();
        assert_eq!(
            (d.n_rows(), d.n_cols(), d.nnz()),
            (csr.n_rows(), csr.n_cols(), csr.nnz())
        );
        assert_eq!(d.row_offsets().len(), csr.n_rows() + 1);
        assert_eq!(d.row_indices().to_host().unwrap(), csr.row_indices());
        assert_eq!(d.values().is_some(), csr.values().is_some());
        assert_eq!(d.degree_stats(), &csr.degree_stats());
        assert!(gpu.same_as(d.gpu()));
        assert_eq!(&d.to_host().unwrap(), csr);
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn module_cache_loads_each_module_once() {
    let gpu = open_gpu();
    assert!(!gpu.is_module_loaded(TEST_MODULE));
    let first = gpu
        .load_function(TEST_MODULE, TEST_PTX, "runtime_test_noop")
        .unwrap();
    let again = gpu
        .load_function(TEST_MODULE, TEST_PTX, "runtime_test_noop")
        .unwrap();
    assert_eq!(first.cu_function(), again.cu_function(), "function cached");
    assert_eq!(gpu.loaded_kernels(TEST_MODULE), vec!["runtime_test_noop"]);
    // A second kernel of the same module: loaded from its own piece of the module.
    gpu.load_function(TEST_MODULE, TEST_PTX, "runtime_test_fill_f32")
        .unwrap();
    assert_eq!(gpu.loaded_modules(), vec![TEST_MODULE]);
    assert_eq!(
        gpu.loaded_kernels(TEST_MODULE),
        vec!["runtime_test_fill_f32", "runtime_test_noop"]
    );
    // A kernel the module's text lacks never reaches the driver.
    assert!(matches!(
        gpu.load_function(TEST_MODULE, TEST_PTX, "runtime_test_missing"),
        Err(Error::KernelNotFound { .. })
    ));

    // Many threads at once: still one module, the same function everywhere.
    let handles: Vec<_> = (0..8)
        .map(|_| {
            let gpu = gpu.clone();
            std::thread::spawn(move || {
                gpu.load_function(TEST_MODULE, TEST_PTX, "runtime_test_noop")
                    .unwrap()
                    .cu_function() as usize
            })
        })
        .collect();
    for h in handles {
        assert_eq!(h.join().unwrap(), first.cu_function() as usize);
    }
    assert_eq!(gpu.loaded_modules().len(), 1);

    // Through a `PtxModule`, a kernel the module does not list never reaches the driver.
    let listed = PtxModule {
        name: TEST_MODULE,
        ptx: TEST_PTX,
        kernels: &["runtime_test_noop", "runtime_test_fill_f32"],
    };
    let f = gpu.function(&listed, "runtime_test_noop").unwrap();
    assert_eq!(f.cu_function(), first.cu_function());
    assert!(matches!(
        gpu.function(&listed, "no_such_kernel"),
        Err(Error::KernelNotFound {
            module: TEST_MODULE,
            ..
        })
    ));

    // A fresh handle has its own cache.
    assert!(open_gpu().loaded_modules().is_empty());
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn generated_modules_load_on_this_device() {
    let gpu = open_gpu();
    for module in spattn_kernels_sys::MODULES {
        assert!(matches!(
            gpu.function(module, "no_such_kernel"),
            Err(Error::KernelNotFound { .. })
        ));
        assert!(
            !gpu.is_module_loaded(module.name),
            "unknown kernels load nothing"
        );
        gpu.preload(module)
            .unwrap_or_else(|e| panic!("module {}: {e}", module.name));
        assert!(gpu.is_module_loaded(module.name));
    }
}

fn launch_fill(gpu: &Gpu, out: &mut DeviceVec<f32>, value: f32) -> crate::Result<()> {
    const KERNEL: &str = "runtime_test_fill_f32";
    check_same_gpu(gpu, "out", out)?;
    let f = gpu.load_function(TEST_MODULE, TEST_PTX, KERNEL)?;
    let n = to_u32("out length", out.len())?;
    let cfg = grid_1d(out.len(), 256)?;
    let mut args = gpu.launch_builder(&f);
    args.arg(out.slice_mut()).arg(&n).arg(&value);
    // SAFETY: runtime_test_fill_f32(float* out, unsigned n, float v) writes out[0..n) and
    // nothing else; `out` holds n elements and belongs to `gpu` (checked above).
    unsafe { launch(KERNEL, &mut args, cfg) }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn kernels_launch_through_the_plumbing() {
    let gpu = open_gpu();
    for n in [0usize, 1, 255, 257, 100_003] {
        let mut out = DeviceVec::<f32>::zeros(&gpu, n).unwrap();
        out.fill_nan().unwrap();
        launch_fill(&gpu, &mut out, 3.25).unwrap();
        gpu.synchronize().unwrap();
        assert!(out.to_host().unwrap().iter().all(|&x| x == 3.25), "n = {n}");
    }
    // A bad configuration is a typed error naming the problem, not a driver failure.
    let f = gpu
        .load_function(TEST_MODULE, TEST_PTX, "runtime_test_noop")
        .unwrap();
    let mut args = gpu.launch_builder(&f);
    let cfg = crate::launch::LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (2048, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the noop kernel takes no arguments and touches no memory.
    let err = unsafe { launch("runtime_test_noop", &mut args, cfg) }.unwrap_err();
    assert!(matches!(err, Error::InvalidArgument { .. }), "{err}");
}

/// Failures only the driver can see become typed errors. This test makes three driver calls
/// fail on purpose, which `compute-sanitizer` reports as API errors: run the sanitizer with
/// `--skip driver_rejections` (or `--report-api-errors no`).
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn driver_rejections_are_typed_errors() {
    let gpu = open_gpu();
    assert!(matches!(
        gpu.load_function(TEST_MODULE, TEST_PTX, "no_such_kernel"),
        Err(Error::KernelNotFound {
            module: TEST_MODULE,
            ..
        })
    ));
    assert!(matches!(
        gpu.load_function("broken", "this is not PTX", "k"),
        Err(Error::ModuleLoad {
            module: "broken",
            ..
        })
    ));
    assert!(
        !gpu.is_module_loaded("broken"),
        "a failed load is not cached"
    );
    let f = gpu
        .load_function(TEST_MODULE, TEST_PTX, "runtime_test_noop")
        .unwrap();
    let mut args = gpu.launch_builder(&f);
    // Too much shared memory: the driver refuses, and the error names the kernel.
    let cfg = crate::launch::LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (32, 1, 1),
        shared_mem_bytes: u32::MAX,
    };
    // SAFETY: the noop kernel takes no arguments and touches no memory.
    let err = unsafe { launch("runtime_test_noop", &mut args, cfg) }.unwrap_err();
    assert!(
        matches!(
            err,
            Error::Driver {
                during: "runtime_test_noop",
                ..
            }
        ),
        "{err}"
    );
    // The context is still usable afterwards (none of these errors is sticky).
    let mut out = DeviceVec::<f32>::zeros(&gpu, 10).unwrap();
    launch_fill(&gpu, &mut out, 2.0).unwrap();
    assert_eq!(out.to_host().unwrap(), vec![2.0; 10]);
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn selftest_kernel_launches_if_present() {
    const KERNEL: &str = "selftest_fill_f32";
    let Some(module) = spattn_kernels_sys::MODULES
        .iter()
        .find(|m| m.kernels.contains(&KERNEL))
    else {
        eprintln!("no {KERNEL} in spattn-kernels-sys yet: nothing to launch");
        return;
    };
    let gpu = open_gpu();
    let f = gpu.function(module, KERNEL).unwrap();
    for n in [1usize, 1000, 1 << 20] {
        let mut out = DeviceVec::<f32>::zeros(&gpu, n).unwrap();
        out.fill_nan().unwrap();
        let count = to_u32("n", n).unwrap();
        let value = -7.5f32;
        let cfg = grid_1d(n, 256).unwrap();
        let mut args = gpu.launch_builder(&f);
        args.arg(out.slice_mut()).arg(&count).arg(&value);
        // SAFETY: selftest_fill_f32(float* out, unsigned n, float v) writes out[0..n); `out`
        // holds n elements on `gpu`.
        unsafe { launch(KERNEL, &mut args, cfg) }.unwrap();
        assert!(
            out.to_host().unwrap().iter().all(|&x| x == value),
            "n = {n}"
        );
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn timer_measures_positive_time() {
    let gpu = open_gpu();
    let mut big = DeviceVec::<f32>::zeros(&gpu, 1 << 26).unwrap();
    let ms = gpu.time_ms(|| big.fill(1.0)).unwrap();
    assert!(ms > 0.0 && ms.is_finite(), "{ms} ms");

    let mut timer = gpu.timer().unwrap();
    assert!(timer.elapsed_ms().is_err(), "not started");
    assert!(timer.stop().is_err(), "stop before start");
    for _ in 0..3 {
        timer.start().unwrap();
        big.fill_nan().unwrap();
        timer.stop().unwrap();
        let ms = timer.elapsed_ms().unwrap();
        assert!(ms > 0.0 && ms.is_finite(), "{ms} ms");
    }
    // An error inside the timed closure comes out as is.
    let err = gpu
        .time_ms(|| Err(Error::ForeignGpu { what: "x" }))
        .unwrap_err();
    assert!(matches!(err, Error::ForeignGpu { what: "x" }));
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn bad_ordinals_are_no_device() {
    let count = Gpu::device_count().unwrap();
    assert!(count >= 1);
    assert!(Gpu::is_available());
    for ordinal in [count, count + 7, usize::MAX] {
        match Gpu::new(ordinal) {
            Err(Error::NoDevice {
                ordinal: o,
                count: c,
            }) => assert_eq!((o, c), (ordinal, count)),
            other => panic!("ordinal {ordinal}: expected NoDevice, got {other:?}"),
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn device_properties_and_capability_checks() {
    let gpu = open_gpu();
    eprintln!("{gpu:?}, driver {:?}", gpu.driver_version().unwrap());
    assert!(!gpu.name().is_empty());
    assert!(gpu.sm_count() > 0);
    assert!(gpu.compute_capability() >= (5, 0));
    assert!(gpu.max_shared_memory_per_block().unwrap() >= 48 * 1024);
    assert!(gpu.driver_version().unwrap() >= (11, 0));
    let (free, total) = gpu.memory_info().unwrap();
    assert!(0 < free && free <= total);
    gpu.require_compute_capability("anything", 1, 0).unwrap();
    let (major, minor) = gpu.compute_capability();
    gpu.require_compute_capability("this device", major, minor)
        .unwrap();
    assert!(matches!(
        gpu.require_compute_capability("the future", 99, 0),
        Err(Error::UnsupportedComputeCapability {
            what: "the future",
            need_major: 99,
            ..
        })
    ));
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn buffers_of_another_handle_are_refused() {
    let a = open_gpu();
    let b = open_gpu();
    let m = DeviceMatrix::<f32>::zeros(&a, Shape::new(4, 1, 1).unwrap()).unwrap();
    check_same_gpu(&a, "Q", &m).unwrap();
    check_same_gpu(&a.clone(), "Q", &m).unwrap();
    assert!(matches!(
        check_same_gpu(&b, "Q", &m),
        Err(Error::ForeignGpu { what: "Q" })
    ));
    assert!(a.owns(m.slice()) && !b.owns(m.slice()));
    let mut out = DeviceVec::<f32>::zeros(&a, 4).unwrap();
    assert!(matches!(
        launch_fill(&b, &mut out, 1.0),
        Err(Error::ForeignGpu { what: "out" })
    ));
}
