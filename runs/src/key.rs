//! The one derivation of an effect's idempotency key from `(run id, step id)`: every
//! attempt of every process of a run derives the same key for the same step, and no two
//! steps share one. Deliveries (`dlv_…`) and the effects ledger (`eff_…`) prefix it.

use airlock_core::ids::RunId;
use sha2::{Digest, Sha256};

/// Domain separation of the key's hash.
const CONTEXT: &[u8] = b"airlock/v1\0";

/// The first 32 hex characters of sha256(`"airlock/v1\0" + run_id + "\0" + step_id`), the
/// run id in its hyphenated lowercase form.
pub fn digest(run_id: RunId, step_id: &str) -> String {
    let mut hasher = Sha256::new();
    hasher.update(CONTEXT);
    hasher.update(run_id.uuid().hyphenated().to_string().as_bytes());
    hasher.update(b"\0");
    hasher.update(step_id.as_bytes());
    hex::encode(hasher.finalize())[..32].to_string()
}
