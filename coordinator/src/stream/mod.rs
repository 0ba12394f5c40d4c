//! The data stream: documents and their ids, the readers, tokenizers, chat
//! templates and token cache that make them ([`data`]), the cursor that
//! says where a job's stream stands, mixtures of sources, and the planner
//! that packs a step's documents into microbatches ([`plan`]). Imports
//! only [`crate::job`] (the spec sections it serves).

pub mod cursor;
pub mod data;
pub mod doc;
pub mod mix;
pub mod plan;
pub mod prefetch;
