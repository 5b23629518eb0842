//! Embeddings' `f32`s written as `f64`s, as `json!` wrote them (every dialect's answers).

use serde::{Serialize, Serializer};

/// `f32`s written as `f64`s.
pub(crate) fn f32s_as_f64s<S: Serializer>(v: &[f32], s: S) -> Result<S::Ok, S::Error> {
    s.collect_seq(v.iter().map(|x| f64::from(*x)))
}

/// Vectors of `f32`s written as vectors of `f64`s.
pub(crate) fn vectors_as_f64s<S: Serializer>(v: &[Vec<f32>], s: S) -> Result<S::Ok, S::Error> {
    /// One vector, for `collect_seq`.
    struct Floats<'a>(&'a [f32]);
    impl Serialize for Floats<'_> {
        fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
            f32s_as_f64s(self.0, s)
        }
    }
    s.collect_seq(v.iter().map(|x| Floats(x)))
}
