//! Whether tensors hold only finite values (a leaf both trainers and the
//! probe use).

/// Whether every defined tensor of `ts` is finite.
pub fn all_finite<'a>(ts: impl IntoIterator<Item = &'a tch::Tensor>) -> bool {
    ts.into_iter()
        .filter(|t| t.defined())
        .all(|t| t.isfinite().all().int64_value(&[]) != 0)
}
