//! One row → the body of a document, by the job's data format.

use serde_json::Value as Json;

use super::format::Encoder;
use super::{dpo, rollout, sft};
use crate::job::data::DataFormat;
use crate::stream::doc::DocBody;

/// Builds the body of one row for a format; the error is the reason.
pub fn build_doc(enc: &Encoder, format: DataFormat, row: &Json) -> Result<DocBody, String> {
    Ok(match format {
        DataFormat::Sft => DocBody::Sft(sft::sft_row(enc, row)?),
        DataFormat::Dpo => {
            let (chosen, rejected) = dpo::dpo_row(enc, row)?;
            DocBody::Pair { chosen, rejected }
        }
        DataFormat::Rollouts => DocBody::Rollout(rollout::rollout_row(enc, row)?),
        DataFormat::Prompts => {
            return Err("prompt rows are read by the RL loop (data.source = \"generate\"), not as training documents".into())
        }
    })
}
