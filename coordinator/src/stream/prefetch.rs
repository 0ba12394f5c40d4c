//! Cache prefetch hints: the core starts loading a line and goes on, never
//! waits. A plan reads its documents and their token rows scattered over
//! memory; asking for all of a microbatch's before using any lets the
//! misses overlap instead of following one another (issue 19). A plain
//! load whose value is thrown away (the fallback off x86_64) still holds
//! the core until its line arrives.

/// The cache line holding `bytes`' first byte.
pub fn first_line(bytes: &[u8]) {
    line(bytes.as_ptr());
    #[cfg(not(target_arch = "x86_64"))]
    std::hint::black_box(bytes.first().copied());
}

/// Every cache line `value` spans.
pub fn value<T>(value: &T) {
    let start = std::ptr::from_ref(value).cast::<u8>();
    for offset in (0..size_of::<T>()).step_by(64) {
        line(start.wrapping_add(offset));
    }
}

fn line(at: *const u8) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        // SAFETY: SSE is part of every x86_64 target, and a prefetch never
        // faults, whatever the address.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(at.cast()) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = at;
}
