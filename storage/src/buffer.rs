//! 4 KiB-aligned, zero-initialised buffers for O_DIRECT reads, and a pool with a hard byte cap.

use std::alloc::{self, Layout};
use std::ptr::NonNull;
use std::sync::{Arc, Condvar, Mutex};

use crate::error::{Result, StorageError};
use crate::stripe::{align_up, ALIGN};

/// A buffer aligned to [`ALIGN`] whose capacity is a multiple of [`ALIGN`]: on the heap, or
/// (from [`MAPPED_BUF_BYTES`]) an anonymous mapping. Always fully initialised (allocated
/// zeroed, or zero pages), so handing out slices is sound.
#[derive(Debug)]
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    cap: usize,
    len: usize,
    /// Mapped anonymously (large buffers) instead of taken from the heap.
    mapped: bool,
}

/// Buffers of at least this many bytes are anonymous mappings: the kernel hands them out as
/// zero pages, faulted in by the first write (the O_DIRECT read filling them, on its I/O
/// thread), instead of the allocator clearing every byte on the caller's thread first: an
/// aligned `alloc_zeroed` is a `memset`, 2-4 ms per 17.5 MB expert of the k3-width synth on
/// the forward pass's thread. Unmapped when dropped, so freed experts leave the RSS at once.
pub const MAPPED_BUF_BYTES: usize = 1 << 20;

// SAFETY: AlignedBuf owns its allocation exclusively, like a Vec<u8>.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared access only hands out &[u8]; mutation needs &mut.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// A zeroed buffer of `len` bytes (capacity rounded up to 4 KiB).
    pub fn zeroed(len: usize) -> AlignedBuf {
        let cap = align_up(len.max(1) as u64) as usize;
        let layout = Self::layout(cap);
        if cap >= MAPPED_BUF_BYTES {
            // SAFETY: an anonymous private mapping of `cap` bytes (no file, no fixed address);
            // the result is checked below.
            let raw = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    cap,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                )
            };
            if raw != libc::MAP_FAILED {
                // Huge pages where the kernel has them on request (THP `madvise`): weights and
                // experts are streamed through by the kernels, whose TLB misses over 4 KiB
                // pages made them 20-25% slower than over the page cache's large folios
                // (k3-width decode over a layout: 0.203 -> 0.171 s per token with the hint, in
                // RAM 0.157). A hint: ignored where unsupported; a huge page only ever covers
                // an aligned 2 MiB inside the mapping, so the RSS stays within its size.
                // SAFETY: `raw` is the mapping just made, `cap` bytes long.
                unsafe { libc::madvise(raw, cap, libc::MADV_HUGEPAGE) };
                if let Some(ptr) = NonNull::new(raw as *mut u8) {
                    // Page-aligned (ALIGN is the page size) and zero-filled by the kernel.
                    return AlignedBuf {
                        ptr,
                        cap,
                        len,
                        mapped: true,
                    };
                }
            }
            // No mapping (the process's map count limit, vm.max_map_count, with very many
            // small experts): the heap instead, rather than abort.
        }
        // SAFETY: layout has non-zero size and a power-of-two alignment.
        let raw = unsafe { alloc::alloc_zeroed(layout) };
        let Some(ptr) = NonNull::new(raw) else {
            alloc::handle_alloc_error(layout)
        };
        AlignedBuf {
            ptr,
            cap,
            len,
            mapped: false,
        }
    }

    fn layout(cap: usize) -> Layout {
        // cap is a non-zero multiple of ALIGN, which is a power of two: always a valid layout.
        Layout::from_size_align(cap, ALIGN as usize).unwrap_or_else(|_| unreachable!())
    }

    pub fn capacity(&self) -> usize {
        self.cap
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Change the visible length (bytes beyond the old length keep whatever they held).
    pub fn set_len(&mut self, len: usize) {
        assert!(len <= self.cap, "length {len} over capacity {}", self.cap);
        self.len = len;
    }

    /// The whole capacity, for reads that must cover aligned lengths.
    pub fn full_mut(&mut self) -> &mut [u8] {
        // SAFETY: ptr is valid for cap initialised bytes, uniquely borrowed through &mut self.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.cap) }
    }

    /// Fault every page of the buffer in now (its contents stay zero), so that the first read
    /// into it does not. A buffer's first touch makes the kernel allocate and clear each page;
    /// on a VM whose host takes freed memory back (virtio balloon free-page reporting) that ran
    /// at 0.3-0.8 GB/s here, slower than the drive, on the I/O thread whose read faulted it.
    pub fn prefault(&mut self) {
        if self.mapped {
            // SAFETY: the mapping made in `zeroed`, `cap` bytes long. POPULATE_WRITE (Linux
            // 5.14) only faults pages in; on older kernels it fails and the loop below does it.
            let r = unsafe {
                libc::madvise(
                    self.ptr.as_ptr() as *mut libc::c_void,
                    self.cap,
                    libc::MADV_POPULATE_WRITE,
                )
            };
            if r == 0 {
                return;
            }
        }
        // Writing a zero over a zero keeps the contents; volatile so that it is not elided.
        for page in (0..self.cap).step_by(ALIGN as usize) {
            // SAFETY: page < cap, inside the allocation, and &mut self makes the access unique.
            unsafe { std::ptr::write_volatile(self.ptr.as_ptr().add(page), 0) };
        }
    }

    /// Raw pointer for workers that fill disjoint ranges concurrently.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

impl std::ops::Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: ptr is valid for cap >= len initialised bytes for the life of self.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl AsRef<[u8]> for AlignedBuf {
    fn as_ref(&self) -> &[u8] {
        self
    }
}

impl std::ops::DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in Deref, and &mut self guarantees uniqueness.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        if self.mapped {
            // SAFETY: mapped in `zeroed` with exactly this length, and no slice of it outlives
            // self. A failure would leave the mapping in place (a leak, not unsoundness).
            unsafe { libc::munmap(self.ptr.as_ptr() as *mut libc::c_void, self.cap) };
            return;
        }
        // SAFETY: allocated in `zeroed` with exactly this layout.
        unsafe { alloc::dealloc(self.ptr.as_ptr(), Self::layout(self.cap)) }
    }
}

#[derive(Debug, Default)]
struct PoolState {
    /// Capacity of buffers handed out and not yet returned.
    in_use: u64,
    /// Returned buffers kept for reuse (their capacity counts against the cap too).
    free: Vec<AlignedBuf>,
    free_bytes: u64,
}

#[derive(Debug)]
struct PoolInner {
    cap: u64,
    state: Mutex<PoolState>,
    returned: Condvar,
}

/// A pool of aligned buffers that never holds more than `cap` bytes (in use plus cached).
#[derive(Clone, Debug)]
pub struct BufferPool {
    inner: Arc<PoolInner>,
}

impl BufferPool {
    pub fn new(cap_bytes: u64) -> BufferPool {
        BufferPool {
            inner: Arc::new(PoolInner {
                cap: cap_bytes,
                state: Mutex::new(PoolState::default()),
                returned: Condvar::new(),
            }),
        }
    }

    pub fn cap(&self) -> u64 {
        self.inner.cap
    }

    /// Bytes currently handed out.
    pub fn in_use(&self) -> u64 {
        self.lock().in_use
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, PoolState> {
        // A panic while holding this lock cannot leave the counters inconsistent (each update
        // is a single assignment), so a poisoned lock is still usable.
        self.inner.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A buffer of `len` bytes; blocks until enough bytes are returned to stay under the cap.
    pub fn acquire(&self, len: usize) -> Result<PooledBuf> {
        let need = align_up(len.max(1) as u64);
        if need > self.inner.cap {
            return Err(StorageError::BufferTooLarge {
                requested: need,
                cap: self.inner.cap,
            });
        }
        let mut st = self.lock();
        loop {
            // Reuse the smallest cached buffer that fits.
            if let Some(i) = st
                .free
                .iter()
                .enumerate()
                .filter(|(_, b)| b.capacity() as u64 >= need && (b.capacity() as u64) < need * 2)
                .min_by_key(|(_, b)| b.capacity())
                .map(|(i, _)| i)
            {
                let mut buf = st.free.swap_remove(i);
                let c = buf.capacity() as u64;
                st.free_bytes -= c;
                st.in_use += c;
                buf.set_len(len);
                return Ok(PooledBuf {
                    buf: Some(buf),
                    pool: self.clone(),
                });
            }
            // Evict cached buffers until a fresh one fits.
            while st.in_use + st.free_bytes + need > self.inner.cap {
                let Some(b) = st.free.pop() else { break };
                st.free_bytes -= b.capacity() as u64;
            }
            if st.in_use + st.free_bytes + need <= self.inner.cap {
                st.in_use += need;
                drop(st);
                let buf = AlignedBuf::zeroed(len);
                return Ok(PooledBuf {
                    buf: Some(buf),
                    pool: self.clone(),
                });
            }
            st = self
                .inner
                .returned
                .wait(st)
                .unwrap_or_else(|p| p.into_inner());
        }
    }

    fn give_back(&self, buf: AlignedBuf) {
        let mut st = self.lock();
        let c = buf.capacity() as u64;
        st.in_use -= c;
        st.free_bytes += c;
        st.free.push(buf);
        drop(st);
        self.inner.returned.notify_all();
    }
}

/// A buffer on loan from a [`BufferPool`]; returns itself on drop.
#[derive(Debug)]
pub struct PooledBuf {
    buf: Option<AlignedBuf>,
    pool: BufferPool,
}

impl PooledBuf {
    fn inner(&self) -> &AlignedBuf {
        self.buf
            .as_ref()
            .unwrap_or_else(|| unreachable!("taken only in drop"))
    }

    pub fn inner_mut(&mut self) -> &mut AlignedBuf {
        self.buf
            .as_mut()
            .unwrap_or_else(|| unreachable!("taken only in drop"))
    }

    pub fn capacity(&self) -> usize {
        self.inner().capacity()
    }
}

impl std::ops::Deref for PooledBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.inner()
    }
}

impl std::ops::DerefMut for PooledBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        self.inner_mut()
    }
}

impl Drop for PooledBuf {
    fn drop(&mut self) {
        if let Some(b) = self.buf.take() {
            self.pool.give_back(b);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_and_zeroed() {
        let b = AlignedBuf::zeroed(10_000);
        assert_eq!(b.as_ptr() as usize % 4096, 0);
        assert_eq!(b.capacity(), 12288);
        assert!(b.iter().all(|&x| x == 0));
    }

    #[test]
    fn large_buffers_are_mapped_zeroed_and_writable() {
        let mut b = AlignedBuf::zeroed(MAPPED_BUF_BYTES + 5);
        assert!(b.mapped);
        assert_eq!(b.as_ptr() as usize % 4096, 0);
        assert_eq!(b.capacity(), MAPPED_BUF_BYTES + 4096);
        assert!(b.full_mut().iter().all(|&x| x == 0));
        b.full_mut().iter_mut().for_each(|x| *x = 7);
        b.set_len(b.capacity());
        assert!(b.iter().all(|&x| x == 7));
        assert!(!AlignedBuf::zeroed(MAPPED_BUF_BYTES - 4096).mapped);
    }

    #[test]
    fn prefaulted_buffers_stay_zero() {
        for len in [10_000, MAPPED_BUF_BYTES + 5, 3 << 20] {
            let mut b = AlignedBuf::zeroed(len);
            b.prefault();
            assert_eq!(b.len(), len);
            assert!(b.full_mut().iter().all(|&x| x == 0), "{len}");
        }
    }

    #[test]
    fn cap_is_hard_and_blocks() {
        let pool = BufferPool::new(3 * 4096);
        let a = pool.acquire(4096).unwrap();
        let b = pool.acquire(8000).unwrap();
        assert_eq!(pool.in_use(), 3 * 4096);
        assert!(matches!(
            pool.acquire(20_000),
            Err(StorageError::BufferTooLarge { .. })
        ));
        let p2 = pool.clone();
        let t = std::thread::spawn(move || p2.acquire(4096).map(|b| b.len()));
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert!(!t.is_finished(), "acquire must wait while the pool is full");
        drop(a);
        assert_eq!(t.join().unwrap().unwrap(), 4096);
        drop(b);
        assert_eq!(pool.in_use(), 0);
        // Reuse keeps the total within the cap.
        let c = pool.acquire(12288).unwrap();
        assert_eq!(c.len(), 12288);
    }
}
