//! Test-only: counts heap allocations made on this thread, so a test can hold the filter's
//! per-request allocations to a budget (each one is work in the VM on every request: the
//! allocator, the copy, the free). The recording host's own bookkeeping is not counted.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

pub struct Counting;

thread_local! {
    static ALLOCATIONS: Cell<u64> = const { Cell::new(0) };
    static BYTES: Cell<u64> = const { Cell::new(0) };
    static PAUSED: Cell<u32> = const { Cell::new(0) };
}

fn note(size: usize) {
    // `try_with`: the thread-locals may be gone while a thread ends.
    let _ = PAUSED.try_with(|p| {
        if p.get() == 0 {
            let _ = ALLOCATIONS.try_with(|a| a.set(a.get() + 1));
            let _ = BYTES.try_with(|b| b.set(b.get() + size as u64));
        }
    });
}

// SAFETY: delegates to the system allocator; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        // SAFETY: the caller's layout, passed on.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as allocated by `alloc` above.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        // SAFETY: the caller's layout, passed on.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note(new_size);
        // SAFETY: as allocated by `alloc` above, with the caller's new size.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

/// Allocations (and reallocations) and bytes asked for on this thread so far.
pub fn snapshot() -> (u64, u64) {
    (ALLOCATIONS.with(Cell::get), BYTES.with(Cell::get))
}

/// Not counted while the guard lives (the recording host's bookkeeping).
pub struct Paused;

pub fn pause() -> Paused {
    PAUSED.with(|p| p.set(p.get() + 1));
    Paused
}

impl Drop for Paused {
    fn drop(&mut self) {
        PAUSED.with(|p| p.set(p.get().saturating_sub(1)));
    }
}
