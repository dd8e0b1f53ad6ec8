//! The element types of the dense operands (Q, K, V, out): f32, f16 and bf16.
//!
//! [`DType`] is the compile-time view, used as the type parameter of
//! [`DeviceMatrix`](crate::DeviceMatrix) and of every op; [`DTypeKind`] is the run-time view,
//! parsed from the command line and printed in results. Both carry the suffix of the kernel
//! names (`spmm_csr_f16`).

use std::fmt;
use std::str::FromStr;

use crate::buffer::DeviceElement;
use crate::error::Error;

/// The run-time name of an element type: what the command line parses and results print.
///
/// ```
/// use spattn_ops::DTypeKind;
/// let kind: DTypeKind = "bf16".parse()?;
/// assert_eq!(kind, DTypeKind::Bf16);
/// assert_eq!(kind.to_string(), "bf16");
/// assert_eq!(kind.size_bytes(), 2);
/// # Ok::<(), spattn_ops::Error>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DTypeKind {
    /// IEEE 754 binary32.
    F32,
    /// IEEE 754 binary16 (`half::f16`).
    F16,
    /// bfloat16 (`half::bf16`): f32's exponent range with an 8-bit significand.
    Bf16,
}

impl DTypeKind {
    /// Every kind, in the order f32, f16, bf16.
    pub const ALL: [DTypeKind; 3] = [DTypeKind::F32, DTypeKind::F16, DTypeKind::Bf16];

    /// The kernel-name suffix and the printed name: `"f32"`, `"f16"` or `"bf16"`.
    pub const fn name(self) -> &'static str {
        match self {
            DTypeKind::F32 => "f32",
            DTypeKind::F16 => "f16",
            DTypeKind::Bf16 => "bf16",
        }
    }

    /// Bytes per element.
    pub const fn size_bytes(self) -> usize {
        match self {
            DTypeKind::F32 => 4,
            DTypeKind::F16 | DTypeKind::Bf16 => 2,
        }
    }
}

impl fmt::Display for DTypeKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for DTypeKind {
    type Err = Error;

    /// Accepts the kernel names `f32` / `f16` / `bf16` and the common aliases (`fp32`,
    /// `float32`, `float`, `fp16`, `float16`, `half`, `bfloat16`), in any case; else
    /// [`Error::InvalidArgument`] naming the text.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "f32" | "fp32" | "float32" | "float" => Ok(DTypeKind::F32),
            "f16" | "fp16" | "float16" | "half" => Ok(DTypeKind::F16),
            "bf16" | "bfloat16" => Ok(DTypeKind::Bf16),
            _ => Err(Error::InvalidArgument {
                what: "element type",
                why: format!("unknown {s:?}: expected f32, f16 or bf16"),
            }),
        }
    }
}

mod sealed {
    /// Keeps [`DType`](super::DType) closed: the kernels exist for these three types only.
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::f16 {}
    impl Sealed for half::bf16 {}
}

/// An element type the kernels are compiled for: `f32`, `half::f16` or `half::bf16`.
///
/// Sealed: the set is closed because every kernel exists once per type, named with
/// [`DType::NAME`] as its suffix.
///
/// ```
/// use spattn_ops::{DType, DTypeKind};
/// use half::bf16;
/// assert_eq!(<bf16 as DType>::NAME, "bf16");
/// assert_eq!(<bf16 as DType>::KIND, DTypeKind::Bf16);
/// assert_eq!(bf16::from_f64(1.5).to_f64(), 1.5);
/// assert!(bf16::nan().to_f64().is_nan());
/// ```
pub trait DType:
    sealed::Sealed
    + DeviceElement
    + Copy
    + Default
    + PartialEq
    + PartialOrd
    + fmt::Debug
    + fmt::Display
    + Send
    + Sync
    + 'static
{
    /// The kernel-name suffix: `"f32"`, `"f16"` or `"bf16"`.
    const NAME: &'static str;
    /// The run-time twin of this type.
    const KIND: DTypeKind;

    /// Widens to f64 (exact for all three types).
    fn to_f64(self) -> f64;
    /// Widens to f32 (exact for all three types).
    fn to_f32(self) -> f32;
    /// Rounds an f64 to the nearest value of this type.
    fn from_f64(value: f64) -> Self;
    /// Rounds an f32 to the nearest value of this type.
    fn from_f32(value: f32) -> Self;
    /// The canonical quiet NaN of this type (the bit pattern the GPU tests poison outputs
    /// with: `0x7fc0_0000` for f32, `0x7e00` for f16, `0x7fc0` for bf16).
    fn nan() -> Self;
}

impl DType for f32 {
    const NAME: &'static str = "f32";
    const KIND: DTypeKind = DTypeKind::F32;
    fn to_f64(self) -> f64 {
        f64::from(self)
    }
    fn to_f32(self) -> f32 {
        self
    }
    fn from_f64(value: f64) -> Self {
        value as f32
    }
    fn from_f32(value: f32) -> Self {
        value
    }
    fn nan() -> Self {
        f32::from_bits(0x7fc0_0000)
    }
}

/// The [`DType`] of a `half` type: `$name`, `$kind`, and its canonical quiet NaN's bits.
macro_rules! half_dtype {
    ($t:ident, $name:literal, $kind:ident, $nan:literal) => {
        impl DType for half::$t {
            const NAME: &'static str = $name;
            const KIND: DTypeKind = DTypeKind::$kind;
            fn to_f64(self) -> f64 {
                half::$t::to_f64(self)
            }
            fn to_f32(self) -> f32 {
                half::$t::to_f32(self)
            }
            fn from_f64(value: f64) -> Self {
                half::$t::from_f64(value)
            }
            fn from_f32(value: f32) -> Self {
                half::$t::from_f32(value)
            }
            fn nan() -> Self {
                half::$t::from_bits($nan)
            }
        }
    };
}

half_dtype!(f16, "f16", F16, 0x7e00);
half_dtype!(bf16, "bf16", Bf16, 0x7fc0);

#[cfg(test)]
mod tests {
    use super::*;
    use half::{bf16, f16};

    fn nan_bits<T: DType>() -> Vec<u8> {
        bytemuck::bytes_of(&T::nan()).to_vec()
    }

    #[test]
    fn names_and_kinds_agree() {
        assert_eq!(<f32 as DType>::KIND.name(), <f32 as DType>::NAME);
        assert_eq!(<f16 as DType>::KIND.name(), <f16 as DType>::NAME);
        assert_eq!(<bf16 as DType>::KIND.name(), <bf16 as DType>::NAME);
        for kind in DTypeKind::ALL {
            assert_eq!(kind.to_string().parse::<DTypeKind>().unwrap(), kind);
        }
        assert_eq!(
            <f16 as DType>::KIND.size_bytes(),
            std::mem::size_of::<f16>()
        );
        assert_eq!(
            <bf16 as DType>::KIND.size_bytes(),
            std::mem::size_of::<bf16>()
        );
    }

    #[test]
    fn parse_aliases_and_errors() {
        assert_eq!("FP16".parse::<DTypeKind>().unwrap(), DTypeKind::F16);
        assert_eq!(" bfloat16 ".parse::<DTypeKind>().unwrap(), DTypeKind::Bf16);
        assert_eq!("float".parse::<DTypeKind>().unwrap(), DTypeKind::F32);
        let err = "f64".parse::<DTypeKind>().unwrap_err();
        assert!(err.to_string().contains("f64"));
    }

    #[test]
    fn nan_bit_patterns() {
        assert_eq!(nan_bits::<f32>(), 0x7fc0_0000u32.to_ne_bytes());
        assert_eq!(nan_bits::<f16>(), 0x7e00u16.to_ne_bytes());
        assert_eq!(nan_bits::<bf16>(), 0x7fc0u16.to_ne_bytes());
        assert!(f32::nan().is_nan() && f16::nan().is_nan() && bf16::nan().is_nan());
    }

    #[test]
    fn conversions_round_trip() {
        for v in [0.0, -1.0, 0.5, 1024.0, -3.0] {
            assert_eq!(<f32 as DType>::from_f64(v).to_f64(), v);
            assert_eq!(<f16 as DType>::from_f64(v).to_f64(), v);
            assert_eq!(<f16 as DType>::from_f32(v as f32).to_f32(), v as f32);
            assert_eq!(<bf16 as DType>::from_f64(v).to_f64(), v);
        }
        assert_eq!(<f16 as DType>::from_f64(-65504.0).to_f64(), -65504.0);
        // Rounding, not truncation.
        assert_eq!(<f16 as DType>::from_f64(1.0 + 1.0 / 4096.0).to_f64(), 1.0);
        assert_eq!(
            <bf16 as DType>::from_f32(1.0 + 1.0 / 128.0 + 1e-4).to_f32(),
            1.0078125
        );
    }
}
