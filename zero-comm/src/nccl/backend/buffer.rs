//! [`NcclBuffer`]: device memory of the NCCL communicator, typed by element.

#[allow(clippy::wildcard_imports)]
use super::*;

/// Device memory holding `E`s, for [`NcclComm`]: a `CudaSlice<u8>` of at least one byte (CUDA
/// cannot allocate zero) and the element count.
///
/// Stored as bytes because [`Element`] is sealed and does not imply cudarc's `DeviceRepr`; the
/// typed views ([`view`](Self::view)) exist for the four element types, which all are.
pub struct NcclBuffer<E: Element> {
    pub(super) bytes: CudaSlice<u8>,
    pub(super) len: usize,
    pub(super) _e: PhantomData<E>,
}

impl<E: Element> fmt::Debug for NcclBuffer<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "NcclBuffer<{}>[{}] on cuda:{}",
            E::DTYPE,
            self.len,
            self.bytes.ordinal()
        )
    }
}

impl<E: Element> NcclBuffer<E> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer holds no element.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// `len` zeroed elements on `stream` (at least one byte: CUDA cannot allocate zero).
    pub(super) fn zeroed(stream: &Arc<CudaStream>, len: usize) -> Result<Self> {
        let bytes = (len * size_of::<E>()).max(1);
        let bytes = stream
            .alloc_zeros::<u8>(bytes)
            .map_err(|e| driver(&format!("allocating {bytes} bytes"), e))?;
        Ok(NcclBuffer {
            bytes,
            len,
            _e: PhantomData,
        })
    }

    /// Copies `src` (of this length) in from host memory, on `stream`.
    pub(super) fn write(&mut self, stream: &Arc<CudaStream>, src: &[E]) -> Result<()> {
        let n = self.num_bytes();
        let mut bytes = self.bytes.slice_mut(0..n);
        stream
            .memcpy_htod(bytemuck::cast_slice::<E, u8>(src), &mut bytes)
            .map_err(|e| driver("upload", e))
    }

    /// Copies the elements into `dst` (of this length) once `stream` gets to it, and waits.
    pub(super) fn read(&self, stream: &Arc<CudaStream>, dst: &mut [E]) -> Result<()> {
        if self.len == 0 {
            return Ok(());
        }
        let src = self.bytes.slice(0..self.num_bytes());
        stream
            .memcpy_dtoh(&src, bytemuck::cast_slice_mut::<E, u8>(dst))
            .map_err(|e| driver("download", e))?;
        // A device-to-pageable copy returns once done; make sure anyway.
        stream.synchronize().map_err(|e| driver("download", e))
    }

    pub(super) fn num_bytes(&self) -> usize {
        self.len * size_of::<E>()
    }

    /// The allocation, as bytes (at least one byte, even when the buffer is empty).
    pub fn as_bytes(&self) -> &CudaSlice<u8> {
        &self.bytes
    }

    /// The allocation, as bytes, mutably.
    pub fn as_bytes_mut(&mut self) -> &mut CudaSlice<u8> {
        &mut self.bytes
    }

    /// The elements as a typed device view (for kernels or copies of the caller's own).
    pub fn view(&self) -> CudaView<'_, E>
    where
        E: DeviceRepr,
    {
        // SAFETY: the allocation holds `len` elements of `E` (it was created for them), and `E`
        // is plain data.
        unsafe { self.bytes.transmute::<E>(self.len) }
            .expect("an NcclBuffer always holds its elements")
    }

    /// The elements as a typed mutable device view.
    pub fn view_mut(&mut self) -> CudaViewMut<'_, E>
    where
        E: DeviceRepr,
    {
        let len = self.len;
        // SAFETY: as in `view`.
        unsafe { self.bytes.transmute_mut::<E>(len) }
            .expect("an NcclBuffer always holds its elements")
    }

    /// Takes over a cudarc slice (no copy). Its stream should be the communicator's, or the
    /// caller orders the two streams (see the module docs).
    pub fn from_cuda_slice(slice: CudaSlice<E>) -> Self
    where
        E: DeviceRepr,
    {
        let stream = slice.stream().clone();
        let len = slice.len();
        if len == 0 {
            // Keep the "at least one byte" invariant; the empty slice is freed on drop.
            if let Ok(bytes) = stream.alloc_zeros::<u8>(1) {
                return NcclBuffer {
                    bytes,
                    len: 0,
                    _e: PhantomData,
                };
            }
        }
        let ptr = slice.leak();
        // SAFETY: `ptr` is the allocation `slice` owned, `len * size_of::<E>()` bytes long, now
        // owned by the new slice (which frees it on drop).
        let bytes = unsafe { stream.upgrade_device_ptr::<u8>(ptr, len * size_of::<E>()) };
        NcclBuffer {
            bytes,
            len,
            _e: PhantomData,
        }
    }

    /// Gives the allocation back as a typed cudarc slice (no copy).
    pub fn into_cuda_slice(self) -> CudaSlice<E>
    where
        E: DeviceRepr,
    {
        let stream = self.bytes.stream().clone();
        let len = self.len;
        let ptr = self.bytes.leak();
        // SAFETY: the allocation holds at least `len` elements of `E` and is owned by the new
        // slice from here on.
        unsafe { stream.upgrade_device_ptr::<E>(ptr, len) }
    }
}
