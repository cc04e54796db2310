//! Reading one safetensors file by its header, tensor by tensor.
//!
//! A real K3 shard is ~16 GB, so we never map or load a whole file: we read the 8-byte length and
//! the JSON header, validate every tensor's extent against the file's size, and then read single
//! tensors (or byte ranges) with positioned reads.

use crate::os::FileAt;
use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use safetensors::Dtype;

use crate::error::{StoreError, io_err};

/// The header of the safetensors crate caps at 100 MB; we refuse anything larger up front so a
/// corrupt length cannot make us allocate gigabytes.
const MAX_HEADER: u64 = 100_000_000;

/// One header entry as written: `{dtype, shape, data_offsets}`. The dtype parses through the
/// safetensors crate's own enum, so its set of names is the format's.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct RawInfo {
    dtype: Dtype,
    shape: Vec<usize>,
    data_offsets: [u64; 2],
}

#[derive(Debug, Clone, PartialEq)]
pub struct TensorEntry {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    /// Absolute byte offset of the tensor's data in the file.
    pub offset: u64,
    pub len: u64,
}

impl TensorEntry {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// An opened safetensors file: its path, size, header and the tensors it holds.
#[derive(Debug)]
pub struct Shard {
    pub path: PathBuf,
    pub file_len: u64,
    /// Raw header bytes (the JSON), kept for provenance hashing.
    pub header_hash: u64,
    pub data_start: u64,
    pub tensors: Vec<TensorEntry>,
    index: HashMap<String, usize>,
    file: File,
}

pub fn dtype_size(d: Dtype) -> Option<usize> {
    Some(match d {
        Dtype::BOOL | Dtype::U8 | Dtype::I8 | Dtype::F8_E4M3 | Dtype::F8_E5M2 => 1,
        Dtype::F16 | Dtype::BF16 | Dtype::I16 | Dtype::U16 => 2,
        Dtype::F32 | Dtype::I32 | Dtype::U32 => 4,
        Dtype::F64 | Dtype::I64 | Dtype::U64 => 8,
        _ => return None,
    })
}

impl Shard {
    pub fn open(path: &Path) -> Result<Self, StoreError> {
        let bad = |msg: String| StoreError::Safetensors { path: path.to_path_buf(), msg };
        let file = File::open(path).map_err(io_err(path))?;
        let file_len = file.metadata().map_err(io_err(path))?.len();
        if file_len < 8 {
            return Err(bad(format!("truncated: {file_len} bytes, too short for a safetensors header")));
        }
        let mut len_bytes = [0u8; 8];
        file.read_exact_at(&mut len_bytes, 0).map_err(io_err(path))?;
        let n = u64::from_le_bytes(len_bytes);
        if n > MAX_HEADER {
            return Err(bad(format!("header length {n} exceeds the {MAX_HEADER}-byte limit")));
        }
        if 8 + n > file_len {
            return Err(bad(format!("header length {n} runs past the end of the {file_len}-byte file")));
        }
        let mut header = vec![0u8; n as usize];
        file.read_exact_at(&mut header, 8).map_err(io_err(path))?;
        let data_start = 8 + n;
        let mut tensors = parse_header(path, &header, file_len)?;
        tensors.sort_by_key(|t| t.offset);
        let index = tensors.iter().enumerate().map(|(i, t)| (t.name.clone(), i)).collect();
        Ok(Shard {
            path: path.to_path_buf(),
            file_len,
            header_hash: crate::checksum::xxh3_64(&header),
            data_start,
            tensors,
            index,
            file,
        })
    }

    pub fn get(&self, name: &str) -> Option<&TensorEntry> {
        self.index.get(name).map(|&i| &self.tensors[i])
    }

    /// Read `len` bytes at absolute `offset` into `buf`.
    pub fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), StoreError> {
        self.file.read_exact_at(buf, offset).map_err(io_err(&self.path))
    }

    /// Read one tensor's raw bytes.
    pub fn read_tensor(&self, t: &TensorEntry) -> Result<Vec<u8>, StoreError> {
        let mut buf = vec![0u8; t.len as usize];
        self.read_at(t.offset, &mut buf)?;
        Ok(buf)
    }
}

/// The tensor entries of a safetensors header (`header` is the JSON after the 8-byte length)
/// of a file of `file_len` bytes, with offsets made absolute; `path` names the file in errors.
/// Works on a header fetched on its own, before the file exists locally.
pub fn parse_header(path: &Path, header: &[u8], file_len: u64) -> Result<Vec<TensorEntry>, StoreError> {
    let bad = |msg: String| StoreError::Safetensors { path: path.to_path_buf(), msg };
    let n = header.len() as u64;
    if 8 + n > file_len {
        return Err(bad(format!("header length {n} runs past the end of the {file_len}-byte file")));
    }
    let text = std::str::from_utf8(header).map_err(|e| bad(format!("header is not UTF-8: {e}")))?;
    // Parse entry by entry (rather than through safetensors' all-or-nothing validation) so an
    // error can name the tensor it concerns.
    let raw: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(text).map_err(|e| bad(format!("header is not a valid safetensors header: {e}")))?;
    let data_start = 8 + n;
    let data_len = file_len - data_start;
    let mut tensors = Vec::new();
    for (name, value) in raw {
        if name == "__metadata__" {
            continue;
        }
        let tbad = |msg: String| StoreError::Tensor { path: path.to_path_buf(), tensor: name.clone(), msg };
        let info: RawInfo = serde_json::from_value(value).map_err(|e| tbad(format!("invalid header entry: {e}")))?;
        let (b, e) = (info.data_offsets[0], info.data_offsets[1]);
        if e < b {
            return Err(tbad(format!("data_offsets [{b}, {e}] end before they begin")));
        }
        if e > data_len {
            return Err(tbad(format!(
                "data_offsets [{b}, {e}] run past the end of the file (data section is {data_len} bytes)"
            )));
        }
        let size = dtype_size(info.dtype).ok_or_else(|| tbad(format!("unsupported dtype {:?}", info.dtype)))?;
        let numel = info
            .shape
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .ok_or_else(|| tbad("shape overflows".into()))?;
        if (numel as u64).checked_mul(size as u64) != Some(e - b) {
            return Err(tbad(format!(
                "shape {:?} x {:?} needs {} bytes but data_offsets span {}",
                info.shape,
                info.dtype,
                numel as u128 * size as u128,
                e - b
            )));
        }
        tensors.push(TensorEntry {
            name: name.clone(),
            dtype: info.dtype,
            shape: info.shape,
            offset: data_start + b,
            len: e - b,
        });
    }
    Ok(tensors)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn write_raw(dir: &Path, header: &str, data: &[u8]) -> PathBuf {
        let p = dir.join("t.safetensors");
        let mut f = File::create(&p).unwrap();
        f.write_all(&(header.len() as u64).to_le_bytes()).unwrap();
        f.write_all(header.as_bytes()).unwrap();
        f.write_all(data).unwrap();
        p
    }

    fn err_of(dir: &Path, header: &str, data: &[u8]) -> String {
        let p = write_raw(dir, header, data);
        Shard::open(&p).unwrap_err().to_string()
    }

    #[test]
    fn reads_a_valid_file() {
        let d = tempfile::tempdir().unwrap();
        let h = r#"{"__metadata__":{"format":"pt"},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"U8","shape":[3],"data_offsets":[8,11]}}"#;
        let mut data = Vec::new();
        data.extend_from_slice(&1.5f32.to_le_bytes());
        data.extend_from_slice(&(-2.0f32).to_le_bytes());
        data.extend_from_slice(&[7, 8, 9]);
        let p = write_raw(d.path(), h, &data);
        let s = Shard::open(&p).unwrap();
        let b = s.get("b").unwrap().clone();
        assert_eq!(s.read_tensor(&b).unwrap(), vec![7, 8, 9]);
        assert_eq!(b.offset, 8 + h.len() as u64 + 8);
    }

    #[test]
    fn malformed_inputs_are_clear_errors() {
        let d = tempfile::tempdir().unwrap();
        // Truncated file: fewer than 8 bytes.
        let p = d.path().join("short.safetensors");
        std::fs::write(&p, [1, 2, 3]).unwrap();
        assert!(Shard::open(&p).unwrap_err().to_string().contains("truncated"));
        // Header length beyond the file.
        let p = d.path().join("long.safetensors");
        let mut bytes = 1000u64.to_le_bytes().to_vec();
        bytes.extend_from_slice(b"{}");
        std::fs::write(&p, bytes).unwrap();
        assert!(Shard::open(&p).unwrap_err().to_string().contains("past the end"));
        // Absurd header length.
        let p = d.path().join("huge.safetensors");
        std::fs::write(&p, u64::MAX.to_le_bytes()).unwrap();
        assert!(Shard::open(&p).unwrap_err().to_string().contains("limit"));
        // Offsets out of range.
        let e = err_of(d.path(), r#"{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}}"#, &[1, 2]);
        assert!(e.contains("'a'") && e.contains("past the end"), "{e}");
        // Offsets that disagree with the shape.
        let e = err_of(d.path(), r#"{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,4]}}"#, &[0; 4]);
        assert!(e.contains("needs 16 bytes"), "{e}");
        // Unknown dtype.
        let e = err_of(d.path(), r#"{"a":{"dtype":"Q9","shape":[1],"data_offsets":[0,1]}}"#, &[0]);
        assert!(e.contains("'a'") && e.contains("Q9"), "{e}");
        // Not JSON at all.
        let e = err_of(d.path(), "not json", &[]);
        assert!(e.contains("valid safetensors header"), "{e}");
        // Reversed offsets.
        let e = err_of(d.path(), r#"{"a":{"dtype":"U8","shape":[0],"data_offsets":[4,0]}}"#, &[0; 4]);
        assert!(e.contains("'a'"), "{e}");
    }
}
