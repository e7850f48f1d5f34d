//! The delivery pipeline end to end through HTTP, and the HTTP surface of both services.
//!
//! One test binary for the group; each module is a suite.
#![allow(clippy::unwrap_used)]

mod archive;
mod delivery;
mod gate;
mod http_surface;
mod slow_clients;
mod webhook_addresses;
