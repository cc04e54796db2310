//! What differs between operating systems for files, in one place: positioned reads and writes
//! (`pread`/`pwrite` on Unix, `seek_read`/`seek_write` on Windows, which may move the file's
//! cursor but take an offset all the same) and whether two paths name one file.

use std::fs::File;
use std::io;
use std::path::Path;

/// Positioned I/O on a file, the same on every platform; callers never share a cursor.
pub trait FileAt {
    /// Read at most `buf.len()` bytes at `offset`; returns how many (0 at end of file).
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize>;
    /// Write at most `buf.len()` bytes at `offset`; returns how many.
    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<usize>;

    /// Fill `buf` from `offset`, or fail with `UnexpectedEof`.
    fn read_exact_at(&self, mut buf: &mut [u8], mut offset: u64) -> io::Result<()> {
        while !buf.is_empty() {
            match self.read_at(buf, offset) {
                Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
                Ok(n) => {
                    buf = &mut buf[n..];
                    offset += n as u64;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Write all of `buf` at `offset`.
    fn write_all_at(&self, mut buf: &[u8], mut offset: u64) -> io::Result<()> {
        while !buf.is_empty() {
            match self.write_at(buf, offset) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => {
                    buf = &buf[n..];
                    offset += n as u64;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
}

#[cfg(unix)]
impl FileAt for File {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        std::os::unix::fs::FileExt::read_at(self, buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<usize> {
        std::os::unix::fs::FileExt::write_at(self, buf, offset)
    }
}

#[cfg(windows)]
impl FileAt for File {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        std::os::windows::fs::FileExt::seek_read(self, buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<usize> {
        std::os::windows::fs::FileExt::seek_write(self, buf, offset)
    }
}

/// Whether two paths name the same file or directory, whatever their spelling (`d`, `d/.`,
/// `d/../d`, a link to `d`): the same device and inode on Unix, the same canonical path
/// elsewhere.
pub fn same_file(a: &Path, b: &Path) -> io::Result<bool> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        let (ma, mb) = (std::fs::metadata(a)?, std::fs::metadata(b)?);
        Ok(ma.dev() == mb.dev() && ma.ino() == mb.ino())
    }
    #[cfg(not(unix))]
    {
        Ok(std::fs::canonicalize(a)? == std::fs::canonicalize(b)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn positioned_io_reads_what_it_wrote_and_reports_the_end() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f");
        let f = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(&p).unwrap();
        f.write_all_at(b"hello world", 3).unwrap();
        let mut b = [0u8; 5];
        f.read_exact_at(&mut b, 9).unwrap();
        assert_eq!(&b, b"world");
        assert_eq!(f.read_exact_at(&mut b, 12).unwrap_err().kind(), io::ErrorKind::UnexpectedEof);
        assert!(same_file(&p, &dir.path().join(".").join("f")).unwrap());
        assert!(!same_file(&p, dir.path()).unwrap());
    }
}
