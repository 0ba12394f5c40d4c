//! The store's errors, and its JSON records read and written.

use serde::{Deserialize, Serialize};

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("state store {path}: {source}")]
    Open {
        path: String,
        source: redb::DatabaseError,
    },
    #[error("state store: {0}")]
    Db(String),
    #[error("state store record {key}: {source}")]
    Decode {
        key: String,
        source: serde_json::Error,
    },
    #[error("state store record {what}: {message}")]
    Corrupt { what: String, message: String },
}

macro_rules! db_err {
    ($($t:ty),*) => {$(
        impl From<$t> for StoreError {
            fn from(e: $t) -> Self {
                StoreError::Db(e.to_string())
            }
        }
    )*};
}
db_err!(
    redb::TransactionError,
    redb::TableError,
    redb::StorageError,
    redb::CommitError
);

pub type Result<T> = std::result::Result<T, StoreError>;

pub(super) fn json<T: Serialize>(v: &T) -> Vec<u8> {
    serde_json::to_vec(v).expect("store records always serialise")
}

pub(super) fn decode<T: for<'de> Deserialize<'de>>(key: &str, bytes: &[u8]) -> Result<T> {
    serde_json::from_slice(bytes).map_err(|source| StoreError::Decode {
        key: key.to_string(),
        source,
    })
}
