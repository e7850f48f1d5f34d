//! airlock driven by clients that are not airlock's own: the receivers' Standard Webhooks
//! library verifying the requests airlock really sent, and an independent OpenAPI
//! validator reading both services' live documents.
//!
//! One test binary for the group; each module is a suite.
#![allow(clippy::unwrap_used)]

mod openapi;
mod webhook_signatures;
