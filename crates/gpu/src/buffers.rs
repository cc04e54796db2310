//! Data in GPU memory: f32 vectors and MXFP4 matrices, uploaded from host slices and read back.

use wgpu::util::DeviceExt;

use crate::{Gpu, GpuError};

/// An f32 vector (or a row-major matrix of them) in GPU memory.
pub struct GpuVec {
    pub(crate) buf: wgpu::Buffer,
    pub(crate) len: usize,
}

impl GpuVec {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// An MXFP4 matrix in GPU memory, as the store holds it. Shapes: packed `[rows, cols/2]` bytes,
/// scales `[rows, cols/32]` E8M0 bytes (padded to whole words in the buffer).
pub struct GpuMxfp4 {
    pub(crate) packed: wgpu::Buffer,
    pub(crate) scales: wgpu::Buffer,
    pub rows: usize,
    pub cols: usize,
}

impl GpuMxfp4 {
    /// Bytes of the matrix as stored (what a product must read).
    pub fn bytes(&self) -> usize {
        self.rows * self.cols / 2 + self.rows * self.cols / 32
    }
}

/// An int8 matrix in GPU memory with one f32 scale per `group` consecutive elements of a row.
/// Shapes: q `[rows, cols]` int8, scales `[rows, cols/group]` f32.
pub struct GpuInt8 {
    pub(crate) q: wgpu::Buffer,
    pub(crate) scales: wgpu::Buffer,
    pub rows: usize,
    pub cols: usize,
    pub group: usize,
}

impl GpuInt8 {
    /// Bytes of the matrix as stored (what a product must read).
    pub fn bytes(&self) -> usize {
        self.rows * self.cols + self.rows * (self.cols / self.group) * 4
    }
}

/// A dense matrix's values on the host: bf16 as raw bits, or f32.
#[derive(Clone, Copy)]
pub enum DenseValues<'a> {
    Bf16(&'a [u16]),
    F32(&'a [f32]),
}

/// A dense bf16 or f32 matrix in GPU memory. Shapes: `[rows, cols]`, row-major.
pub struct GpuDense {
    pub(crate) w: wgpu::Buffer,
    pub rows: usize,
    pub cols: usize,
    /// Bytes per value: 2 (bf16) or 4 (f32).
    pub width: usize,
}

impl GpuDense {
    pub fn bytes(&self) -> usize {
        self.rows * self.cols * self.width
    }
}

/// Storage that is written from the host (`Queue::write_buffer`) and read back.
const STORAGE: wgpu::BufferUsages =
    wgpu::BufferUsages::STORAGE.union(wgpu::BufferUsages::COPY_SRC).union(wgpu::BufferUsages::COPY_DST);

impl Gpu {
    fn check_size(&self, what: &'static str, bytes: usize) -> Result<(), GpuError> {
        let limit = self.max_binding();
        if bytes as u64 > limit {
            return Err(GpuError::TooLarge { what, bytes: bytes as u64, limit });
        }
        Ok(())
    }

    fn storage(&self, label: &str, bytes: &[u8]) -> wgpu::Buffer {
        self.device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
            label: Some(label),
            contents: bytes,
            usage: STORAGE,
        })
    }

    /// Upload an f32 vector (or matrix).
    pub fn upload_f32(&self, v: &[f32]) -> Result<GpuVec, GpuError> {
        // A binding must not be empty: a zero-length vector gets one word nobody reads.
        let bytes: &[u8] = if v.is_empty() { &[0u8; 4] } else { bytemuck::cast_slice(v) };
        self.check_size("a vector", bytes.len())?;
        Ok(GpuVec { buf: self.storage("f32", bytes), len: v.len() })
    }

    /// A zeroed f32 vector of `len`, for outputs.
    pub fn zeros_f32(&self, len: usize) -> Result<GpuVec, GpuError> {
        let bytes = (len.max(1) * 4) as u64;
        self.check_size("a vector", bytes as usize)?;
        let buf = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("f32 out"),
            size: bytes,
            usage: STORAGE,
            mapped_at_creation: false,
        });
        Ok(GpuVec { buf, len })
    }

    /// Upload an MXFP4 matrix. Shapes: packed `[rows, cols/2]`, scales `[rows, cols/32]`, `cols`
    /// a multiple of 32.
    pub fn upload_mxfp4(&self, packed: &[u8], scales: &[u8], rows: usize, cols: usize) -> Result<GpuMxfp4, GpuError> {
        if cols == 0 || !cols.is_multiple_of(32) || rows == 0 {
            return Err(GpuError::Shape {
                what: "an MXFP4 matrix",
                why: format!("{rows} x {cols}: cols must be a positive multiple of 32"),
            });
        }
        if packed.len() != rows * cols / 2 || scales.len() != rows * cols / 32 {
            return Err(GpuError::Shape {
                what: "an MXFP4 matrix",
                why: format!(
                    "{rows} x {cols} needs {} packed and {} scale bytes, got {} and {}",
                    rows * cols / 2,
                    rows * cols / 32,
                    packed.len(),
                    scales.len()
                ),
            });
        }
        self.check_size("an MXFP4 matrix", packed.len())?;
        // Scales are read as u32 words: pad the tail to a whole word.
        let mut sc = scales.to_vec();
        sc.resize(scales.len().next_multiple_of(4), 0);
        Ok(GpuMxfp4 {
            packed: self.storage("mxfp4 packed", packed),
            scales: self.storage("mxfp4 scales", &sc),
            rows,
            cols,
        })
    }

    /// An MXFP4 matrix's buffers, to be written later (an expert slot, a cached expert).
    pub(crate) fn empty_mxfp4(&self, rows: usize, cols: usize) -> Result<GpuMxfp4, GpuError> {
        if cols == 0 || !cols.is_multiple_of(32) || rows == 0 {
            return Err(GpuError::Shape {
                what: "an MXFP4 matrix",
                why: format!("{rows} x {cols}: cols must be a positive multiple of 32"),
            });
        }
        self.check_size("an MXFP4 matrix", rows * cols / 2)?;
        let buffer = |label: &str, size: usize| {
            self.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some(label),
                size: size as u64,
                usage: STORAGE,
                mapped_at_creation: false,
            })
        };
        Ok(GpuMxfp4 {
            packed: buffer("mxfp4 packed", rows * cols / 2),
            scales: buffer("mxfp4 scales", (rows * cols / 32).next_multiple_of(4)),
            rows,
            cols,
        })
    }

    /// Upload an int8 matrix. Shapes: q `[rows, cols]`, scales `[rows, cols/group]`; `cols` a
    /// multiple of 32 (a step of the chunk kernel) and `group` of 16 (the shader reads 16 values
    /// at a time from one group).
    pub fn upload_int8(
        &self,
        q: &[i8],
        scales: &[f32],
        group: usize,
        rows: usize,
        cols: usize,
    ) -> Result<GpuInt8, GpuError> {
        check_int8(q, scales, group, rows, cols)?;
        self.check_size("an int8 matrix", q.len())?;
        Ok(GpuInt8 {
            q: self.storage("int8 values", bytemuck::cast_slice(q)),
            scales: self.storage("int8 scales", bytemuck::cast_slice(scales)),
            rows,
            cols,
            group,
        })
    }

    /// An int8 matrix written into `reuse`'s buffers (grown where too small), for a product
    /// whose matrix is not kept on the GPU. Shapes as [`Self::upload_int8`].
    pub(crate) fn write_int8(
        &self,
        q: &[i8],
        scales: &[f32],
        group: usize,
        rows: usize,
        cols: usize,
        reuse: &mut Streamed,
    ) -> Result<GpuInt8, GpuError> {
        check_int8(q, scales, group, rows, cols)?;
        self.check_size("an int8 matrix", q.len())?;
        let (a, b) = reuse.take(self, q.len(), scales.len() * 4);
        self.queue.write_buffer(&a, 0, bytemuck::cast_slice(q));
        self.queue.write_buffer(&b, 0, bytemuck::cast_slice(scales));
        Ok(GpuInt8 { q: a, scales: b, rows, cols, group })
    }

    /// Upload a dense matrix of bf16 values (raw bits) or f32 values. Shapes: `[rows, cols]`,
    /// `cols` a multiple of 32 (a step of the chunk kernel).
    pub fn upload_dense(&self, w: DenseValues<'_>, rows: usize, cols: usize) -> Result<GpuDense, GpuError> {
        let width = check_dense(w, rows, cols)?;
        self.check_size("a dense matrix", rows * cols * width)?;
        Ok(GpuDense { w: self.storage("dense", dense_bytes(w)), rows, cols, width })
    }

    /// A dense matrix written into `reuse`'s buffer (grown where too small), for a product whose
    /// matrix is not kept on the GPU. Shapes as [`Self::upload_dense`].
    pub(crate) fn write_dense(
        &self,
        w: DenseValues<'_>,
        rows: usize,
        cols: usize,
        reuse: &mut Streamed,
    ) -> Result<GpuDense, GpuError> {
        let width = check_dense(w, rows, cols)?;
        self.check_size("a dense matrix", rows * cols * width)?;
        let (a, _) = reuse.take(self, rows * cols * width, 4);
        self.queue.write_buffer(&a, 0, dense_bytes(w));
        Ok(GpuDense { w: a, rows, cols, width })
    }

    /// Read an f32 vector back to the host (waits for everything submitted before).
    pub fn read_f32(&self, v: &GpuVec) -> Result<Vec<f32>, GpuError> {
        let mut out = vec![0f32; v.len];
        self.read_f32_into(v, &self.staging(v.len), &mut out)?;
        Ok(out)
    }

    /// A buffer the host maps to read results of up to `len` values.
    pub(crate) fn staging(&self, len: usize) -> wgpu::Buffer {
        self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("readback"),
            size: (len.max(1) * 4) as u64,
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        })
    }

    /// Read the first `out.len()` values of `v` into `out` through `staging` (a buffer of
    /// [`Self::staging`] at least that large, kept by callers that read often); waits for
    /// everything submitted before.
    pub(crate) fn read_f32_into(&self, v: &GpuVec, staging: &wgpu::Buffer, out: &mut [f32]) -> Result<(), GpuError> {
        let size = (out.len().max(1) * 4) as u64;
        let mut enc = self.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("readback") });
        enc.copy_buffer_to_buffer(&v.buf, 0, staging, 0, size);
        self.queue.submit([enc.finish()]);
        self.map_and_wait(staging.slice(..size), wgpu::MapMode::Read, "a result")?;
        let data =
            staging.slice(..size).get_mapped_range().map_err(|e| GpuError::Lost(format!("reading a result: {e}")))?;
        // One copy (a chunk's outputs are hundreds of MB): mapped ranges are aligned for f32.
        let values: &[f32] =
            bytemuck::try_cast_slice(&data).map_err(|e| GpuError::Lost(format!("a result as f32: {e}")))?;
        out.copy_from_slice(&values[..out.len()]);
        drop(data);
        staging.unmap();
        Ok(())
    }

    /// Map `slice` for `mode` and wait until it is mapped (after everything submitted before);
    /// `what` names it in errors.
    fn map_and_wait(&self, slice: wgpu::BufferSlice<'_>, mode: wgpu::MapMode, what: &str) -> Result<(), GpuError> {
        let (tx, rx) = std::sync::mpsc::channel();
        slice.map_async(mode, move |r| {
            let _ = tx.send(r);
        });
        self.wait()?;
        match rx.recv() {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(GpuError::Lost(format!("mapping {what}: {e}"))),
            Err(_) => Err(GpuError::Lost(format!("the mapping of {what} never completed"))),
        }
    }

    /// A uniform buffer holding `words`.
    pub(crate) fn uniform(&self, words: &[u32]) -> wgpu::Buffer {
        let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
        self.device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
            label: Some("dims"),
            contents: &bytes,
            usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
        })
    }
}

fn check_int8(q: &[i8], scales: &[f32], group: usize, rows: usize, cols: usize) -> Result<(), GpuError> {
    let what = "an int8 matrix";
    if rows == 0
        || cols == 0
        || group == 0
        || !cols.is_multiple_of(32)
        || !group.is_multiple_of(16)
        || !cols.is_multiple_of(group)
    {
        return Err(GpuError::Shape {
            what,
            why: format!(
                "{rows} x {cols} in groups of {group}: cols must be a positive multiple of 32 and group of 16, the group dividing cols"
            ),
        });
    }
    if q.len() != rows * cols || scales.len() != rows * (cols / group) {
        return Err(GpuError::Shape {
            what,
            why: format!(
                "{rows} x {cols} in groups of {group} needs {} values and {} scales, got {} and {}",
                rows * cols,
                rows * (cols / group),
                q.len(),
                scales.len()
            ),
        });
    }
    Ok(())
}

/// The dense matrix's bytes per value, once its shape is checked.
fn check_dense(w: DenseValues<'_>, rows: usize, cols: usize) -> Result<usize, GpuError> {
    let (len, width) = match w {
        DenseValues::Bf16(v) => (v.len(), 2),
        DenseValues::F32(v) => (v.len(), 4),
    };
    if rows == 0 || cols == 0 || !cols.is_multiple_of(32) || len != rows * cols {
        return Err(GpuError::Shape {
            what: "a dense matrix",
            why: format!("{rows} x {cols} (cols a positive multiple of 32) from {len} values"),
        });
    }
    Ok(width)
}

/// The values' bytes as the shaders read them (little-endian: every target Deltafin builds for
/// is, which the assertion below holds it to).
const _: () = assert!(cfg!(target_endian = "little"), "GPU buffers are written in the host's byte order");

/// The values' bytes as the shaders read them.
fn dense_bytes(w: DenseValues<'_>) -> &[u8] {
    match w {
        DenseValues::Bf16(v) => bytemuck::cast_slice(v),
        DenseValues::F32(v) => bytemuck::cast_slice(v),
    }
}

/// Two storage buffers kept for matrices that pass through the GPU a product at a time (a
/// spine matrix past the GPU's budget), grown to the largest seen.
#[derive(Default)]
pub(crate) struct Streamed {
    bufs: Option<(wgpu::Buffer, wgpu::Buffer)>,
}

impl Streamed {
    /// Buffers of at least `a` and `b` bytes (rounded up to whole words).
    fn take(&mut self, gpu: &Gpu, a: usize, b: usize) -> (wgpu::Buffer, wgpu::Buffer) {
        let (a, b) = (a.div_ceil(4).max(1) as u64 * 4, b.div_ceil(4).max(1) as u64 * 4);
        let fits = self.bufs.as_ref().is_some_and(|(x, y)| x.size() >= a && y.size() >= b);
        if !fits {
            let (oa, ob) = self.bufs.as_ref().map_or((0, 0), |(x, y)| (x.size(), y.size()));
            let make = |size: u64| {
                gpu.device.create_buffer(&wgpu::BufferDescriptor {
                    label: Some("streamed matrix"),
                    size,
                    usage: STORAGE,
                    mapped_at_creation: false,
                })
            };
            self.bufs = Some((make(a.max(oa)), make(b.max(ob))));
        }
        let Some((x, y)) = &self.bufs else { unreachable!("made above") };
        (x.clone(), y.clone())
    }
}

/// A host-visible buffer kept for uploads, so that a chunk's inputs reach the GPU through
/// memory mapped once (`Queue::write_buffer` makes a staging buffer of the write's size on every
/// call, fresh pages the host must fault in: on an H100 that path moved 4.4 GB/s at a 201 MB
/// chunk, `bench --kernels --device gpu`).
#[derive(Default)]
pub(crate) struct Uploader {
    buf: Option<wgpu::Buffer>,
}

impl Uploader {
    /// Copy each part (destination, its byte offset, the bytes: whole words) to the GPU: this
    /// buffer mapped for writing (which waits for its last copy), filled, unmapped, and copied
    /// into the destinations by commands submitted now (work submitted after them sees the
    /// data).
    pub(crate) fn write(&mut self, gpu: &Gpu, parts: &[(&wgpu::Buffer, u64, &[u8])]) -> Result<(), GpuError> {
        let total: u64 = parts.iter().map(|p| p.2.len() as u64).sum();
        if total == 0 {
            return Ok(());
        }
        if self.buf.as_ref().is_none_or(|b| b.size() < total) {
            let size = total.max(self.buf.as_ref().map_or(0, |b| 2 * b.size())).div_ceil(4) * 4;
            self.buf = Some(gpu.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("upload"),
                size,
                usage: wgpu::BufferUsages::MAP_WRITE | wgpu::BufferUsages::COPY_SRC,
                mapped_at_creation: false,
            }));
        }
        let Some(buf) = &self.buf else { unreachable!("made above") };
        gpu.map_and_wait(buf.slice(..total), wgpu::MapMode::Write, "an upload buffer")?;
        {
            let mut view = buf
                .slice(..total)
                .get_mapped_range_mut()
                .map_err(|e| GpuError::Lost(format!("writing an upload buffer: {e}")))?;
            let mut at = 0;
            for (_, _, bytes) in parts {
                view.slice(at..at + bytes.len()).copy_from_slice(bytes);
                at += bytes.len();
            }
        }
        buf.unmap();
        let mut enc = gpu.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("upload") });
        let mut at = 0u64;
        for (dst, offset, bytes) in parts {
            enc.copy_buffer_to_buffer(buf, at, dst, *offset, bytes.len() as u64);
            at += bytes.len() as u64;
        }
        gpu.queue.submit([enc.finish()]);
        Ok(())
    }
}
