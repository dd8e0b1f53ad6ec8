//! Fallible host allocation for buffers whose size comes from input.
//!
//! A file's size line, an edge list's largest index or a command-line shape can ask for more
//! memory than the machine has. `Vec::with_capacity` then aborts the process, and under Linux's
//! overcommit even a successful `try_reserve` can be followed by the OOM killer once the pages
//! are written. So every allocation sized from input goes through [`try_filled`] or
//! [`try_with_capacity`]: the byte count is computed with checked arithmetic, requests of
//! [`CHECKED_BYTES`] or more are compared with the memory the system reports as available
//! ([`available_host_bytes`]), and the reservation itself is `try_reserve_exact`. Each failure
//! is an [`Error::OutOfMemory`] naming the buffer and the bytes it needed.
//!
//! ```
//! use spattn_formats::alloc::try_filled;
//! let v: Vec<u32> = try_filled(4, 7, "row offsets")?;
//! assert_eq!(v, [7, 7, 7, 7]);
//! let e = try_filled::<u64>(usize::MAX, 0, "row offsets").unwrap_err();
//! assert!(e.to_string().contains("row offsets"));
//! # Ok::<(), spattn_formats::Error>(())
//! ```

use crate::error::{Error, Result};

/// Requests below this many bytes skip the comparison with available memory (reading
/// `/proc/meminfo` costs more than such an allocation is worth checking).
pub const CHECKED_BYTES: u64 = 64 << 20;

/// Bytes of `len` values of `T`, or `None` where that overflows 64 bits.
pub fn bytes_of<T>(len: usize) -> Option<u64> {
    (len as u64).checked_mul(std::mem::size_of::<T>() as u64)
}

/// The host memory a new allocation can take without swapping or being killed, where the
/// system says: Linux's `MemAvailable`, capped by the cgroup (v2 or v1) limit less its usage.
/// `None` where neither can be read (other systems): the caller then relies on
/// `try_reserve` alone.
pub fn available_host_bytes() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|text| {
            text.lines()
                .find_map(|l| l.strip_prefix("MemAvailable:"))
                .and_then(|rest| rest.trim().strip_suffix("kB"))
                .and_then(|kb| kb.trim().parse::<u64>().ok())
                .map(|kb| kb.saturating_mul(1024))
        });
    let read_u64 = |path: &str| -> Option<u64> {
        std::fs::read_to_string(path)
            .ok()
            .and_then(|s| s.trim().parse::<u64>().ok())
    };
    // "max" (no limit) does not parse and counts as no cap.
    let cgroup = read_u64("/sys/fs/cgroup/memory.max")
        .map(|max| max.saturating_sub(read_u64("/sys/fs/cgroup/memory.current").unwrap_or(0)))
        .or_else(|| {
            read_u64("/sys/fs/cgroup/memory/memory.limit_in_bytes").map(|max| {
                max.saturating_sub(
                    read_u64("/sys/fs/cgroup/memory/memory.usage_in_bytes").unwrap_or(0),
                )
            })
        });
    match (meminfo, cgroup) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// Checks that `bytes` for `what` can be allocated: not overflowing, and (from
/// [`CHECKED_BYTES`] on) not more than [`available_host_bytes`].
///
/// # Errors
/// [`Error::OutOfMemory`] naming `what`, the bytes and what is available.
pub fn check_host_bytes(what: &'static str, bytes: Option<u64>) -> Result<()> {
    let Some(bytes) = bytes else {
        return Err(Error::OutOfMemory {
            what,
            bytes: u64::MAX,
            available: available_host_bytes(),
        });
    };
    if bytes >= CHECKED_BYTES {
        if let Some(available) = available_host_bytes() {
            if bytes > available {
                return Err(Error::OutOfMemory {
                    what,
                    bytes,
                    available: Some(available),
                });
            }
        }
    }
    Ok(())
}

/// An empty vector with room for exactly `len` values.
///
/// # Errors
/// [`Error::OutOfMemory`] where the bytes overflow, exceed the available memory, or the
/// allocator refuses them.
pub fn try_with_capacity<T>(len: usize, what: &'static str) -> Result<Vec<T>> {
    let bytes = bytes_of::<T>(len);
    check_host_bytes(what, bytes)?;
    let mut v = Vec::new();
    v.try_reserve_exact(len).map_err(|_| Error::OutOfMemory {
        what,
        // check_host_bytes returned early where the count overflowed.
        bytes: bytes.unwrap_or(u64::MAX),
        available: available_host_bytes(),
    })?;
    Ok(v)
}

/// A vector of `len` copies of `value`.
///
/// # Errors
/// As [`try_with_capacity`].
pub fn try_filled<T: Clone>(len: usize, value: T, what: &'static str) -> Result<Vec<T>> {
    let mut v = try_with_capacity(len, what)?;
    v.resize(len, value);
    Ok(v)
}

/// Reserves room for `extra` more values in `v` (fallibly, checked like [`try_with_capacity`]).
///
/// # Errors
/// As [`try_with_capacity`].
pub fn try_reserve<T>(v: &mut Vec<T>, extra: usize, what: &'static str) -> Result<()> {
    let bytes = bytes_of::<T>(extra);
    check_host_bytes(what, bytes)?;
    v.try_reserve(extra).map_err(|_| Error::OutOfMemory {
        what,
        bytes: bytes.unwrap_or(u64::MAX),
        available: available_host_bytes(),
    })
}

/// Formats a byte count for messages: `17179869180 bytes (16.0 GiB)`.
pub fn describe_bytes(bytes: u64) -> String {
    if bytes == u64::MAX {
        return "more than 2^64 bytes".to_string();
    }
    const GIB: f64 = (1u64 << 30) as f64;
    const MIB: f64 = (1u64 << 20) as f64;
    let b = bytes as f64;
    if b >= GIB {
        format!("{bytes} bytes ({:.1} GiB)", b / GIB)
    } else if b >= MIB {
        format!("{bytes} bytes ({:.1} MiB)", b / MIB)
    } else {
        format!("{bytes} bytes")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_allocations_succeed() {
        let v: Vec<u8> = try_with_capacity(10, "x").unwrap();
        assert!(v.capacity() >= 10 && v.is_empty());
        assert_eq!(try_filled(3, 1u16, "y").unwrap(), [1, 1, 1]);
    }

    #[test]
    fn overflow_and_huge_requests_are_errors() {
        let e = try_filled::<u32>(usize::MAX, 0, "row offsets").unwrap_err();
        assert!(matches!(
            e,
            Error::OutOfMemory {
                what: "row offsets",
                bytes: u64::MAX,
                ..
            }
        ));
        assert!(e.to_string().contains("more than 2^64 bytes"), "{e}");
        // 2^60 bytes: no machine has them; either the availability check or the allocator says no.
        let e = try_with_capacity::<u8>(1 << 60, "features").unwrap_err();
        assert!(e.to_string().contains("1152921504606846976 bytes"), "{e}");
    }

    #[test]
    fn byte_descriptions() {
        assert_eq!(describe_bytes(12), "12 bytes");
        assert_eq!(
            describe_bytes(17_179_869_180),
            "17179869180 bytes (16.0 GiB)"
        );
    }
}
