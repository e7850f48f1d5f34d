//! airlock-channels: the outside world, SMTP and webhooks. Only the worker links this crate
//! (the API services cannot send, and the compiler says so).
//!
//! A tour:
//! - [`email`]: SMTP over TLS with lettre, a pool of open connections, Message-IDs derived
//!   from the delivery's idempotency key.
//! - [`webhook`]: an HTTPS POST to an allow-listed origin, signed, with the same
//!   `Idempotency-Key` on every retry.
//! - [`address`]: where a request may connect; names resolved at send time, inward
//!   addresses refused unless an endpoint allows them.
//!
//! Each send returns an [`EffectOutcome`] that says what is known about delivery, which
//! decides the delivery's next state.

pub mod address;
pub mod email;
pub mod webhook;

pub use airlock_delivery::outcome::EffectOutcome;
