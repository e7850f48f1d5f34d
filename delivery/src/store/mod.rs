//! The SQL of deliveries and everything hanging off them, one module per table. Functions
//! take an executor (or the caller's transaction), so the caller decides the transaction.
//!
//! - [`deliveries`]: the current state of each delivery; a submission in one statement;
//!   the locks each transition takes; what transaction A of a send reads.
//! - [`events`]: every state change ([`transition`], [`advance`], [`advance_many`]) with
//!   its hash-chained event rows, and the chain's verification.
//! - [`archive`]: the event log's partitions, made ahead, and its archive of finished
//!   periods, sealed.
//! - [`artifacts`], [`scores`], [`reviews`], [`approvals`]: what scoring and humans add.
//! - [`attempts`] and [`receipts`]: the two ends of a send, fenced on its job's lease
//!   through the queue's statement pieces (the queue alone writes `jobs`).
//! - [`shown`]: everything a delivery's view shows, in one statement.
//! - [`switch`]: the global send switch.
//! - [`suppressions`]: recipients nothing may be sent to, and the recipients the
//!   per-recipient limit counts.

pub mod approvals;
pub mod archive;
pub mod artifacts;
pub mod attempts;
pub mod deliveries;
pub mod events;
pub mod receipts;
pub mod reviews;
pub mod scores;
pub mod shown;
pub mod suppressions;
pub mod switch;

pub use crate::actor::Actor;
pub use approvals::*;
pub use artifacts::*;
pub use attempts::*;
pub use deliveries::*;
pub use events::*;
pub use receipts::*;
pub use reviews::*;
pub use scores::*;
pub use shown::*;
pub use switch::*;
