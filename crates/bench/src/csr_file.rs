//! The binary CSR file that `--dump-csr` writes and peers/torch_peers.py reads:
//!
//! ```text
//! b"SPCSR001"                          8 bytes of magic
//! n_rows, n_cols, nnz                  u64 little-endian each
//! row_offsets                          u32 little-endian × (n_rows + 1)
//! col_indices                          u32 little-endian × nnz
//! ```
//!
//! Pattern only: values are not written (attention masks are binary).

use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::Path;

use spattn_formats::Csr;

use crate::error::{io_error, Error, Result};

/// The first 8 bytes of the file.
pub const MAGIC: &[u8; 8] = b"SPCSR001";

/// Writes `csr`'s pattern to `path` in the binary CSR format.
///
/// # Errors
/// When the file cannot be created or written.
pub fn write_csr(path: &Path, csr: &Csr) -> Result<()> {
    let file = File::create(path).map_err(|e| io_error("create", path, e))?;
    let mut w = BufWriter::with_capacity(1 << 20, file);
    let write_err = |e| io_error("write", path, e);
    w.write_all(MAGIC).map_err(write_err)?;
    for x in [csr.n_rows(), csr.n_cols(), csr.nnz()] {
        w.write_all(&(x as u64).to_le_bytes()).map_err(write_err)?;
    }
    for &x in csr.row_offsets().iter().chain(csr.col_indices()) {
        w.write_all(&x.to_le_bytes()).map_err(write_err)?;
    }
    w.flush().map_err(write_err)
}

/// Reads a binary CSR file (validated by [`Csr::try_new`]).
///
/// # Errors
/// When the file cannot be read, has the wrong magic, is truncated or longer than its header
/// says, or holds an invalid CSR.
pub fn read_csr(path: &Path) -> Result<Csr> {
    let file = File::open(path).map_err(|e| io_error("open", path, e))?;
    let len = file.metadata().map(|m| m.len()).unwrap_or(0);
    let mut r = BufReader::with_capacity(1 << 20, file);
    let mut header = [0u8; 32];
    r.read_exact(&mut header)
        .map_err(|e| io_error("read the header of", path, e))?;
    if &header[..8] != MAGIC {
        return Err(Error::new(format!(
            "{}: not a spattn binary CSR file (magic is not SPCSR001)",
            path.display()
        )));
    }
    let field = |i: usize| {
        let mut b = [0u8; 8];
        b.copy_from_slice(&header[8 + 8 * i..16 + 8 * i]);
        u64::from_le_bytes(b)
    };
    let (n_rows, n_cols, nnz) = (field(0), field(1), field(2));
    let expected = (n_rows as u128 + 1 + nnz as u128) * 4 + 32;
    if expected != len as u128 {
        return Err(Error::new(format!(
            "{}: {len} bytes, but a {n_rows} x {n_cols} CSR with {nnz} entries takes {expected}",
            path.display()
        )));
    }
    let mut read_u32s = |count: u64, what: &str| -> Result<Vec<u32>> {
        let mut bytes = vec![0u8; count as usize * 4];
        r.read_exact(&mut bytes)
            .map_err(|e| io_error(&format!("read the {what} of"), path, e))?;
        Ok(bytes
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    };
    let offsets = read_u32s(n_rows + 1, "row offsets")?;
    let cols = read_u32s(nnz, "column indices")?;
    Csr::try_new(n_rows as usize, n_cols as usize, offsets, cols, None)
        .map_err(|e| Error::new(format!("{}: {e}", path.display())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_errors() {
        let dir = std::env::temp_dir().join(format!("spattn-bench-csr-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let a = Csr::from_edges(4, 5, &[(0, 1), (0, 4), (2, 0), (3, 3)]).unwrap();
        let path = dir.join("a.csr");
        write_csr(&path, &a).unwrap();
        assert_eq!(std::fs::metadata(&path).unwrap().len(), 32 + 4 * (5 + 4));
        assert_eq!(read_csr(&path).unwrap(), a);

        let bytes = std::fs::read(&path).unwrap();
        std::fs::write(&path, &bytes[..bytes.len() - 1]).unwrap();
        assert!(read_csr(&path).unwrap_err().to_string().contains("bytes"));
        let mut bad = bytes.clone();
        bad[0] = b'X';
        std::fs::write(&path, &bad).unwrap();
        assert!(read_csr(&path).unwrap_err().to_string().contains("magic"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
