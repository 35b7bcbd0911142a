//! How Bulkhead's processes talk to each other, the same in the gateway and the workers.
//!
//! - [`wire`]: protocol frames over blocking TCP, or over UCX once a KV connection chose it.
//! - [`door`]: what a connection may hold before it has proved the cluster key (I9): the
//!   handshake deadline, the waiting room's caps and evictions, refusals by reason.
//! - [`handshake`]: the cluster handshake over [`wire`], both sides; the accepting side of
//!   every internal port, once ([`handshake::admit`]).
//! - [`trust`]: where the cluster key comes from, and which listeners may run without one.
//! - [`kv_transport`]: which road a KV connection's frames take (UCX or TCP), chosen per
//!   connection over its authenticated session.
//! - [`metrics`]: what each process counts, as Prometheus families (workers send theirs to
//!   the gateway in `Metrics` messages), and the `/metrics` exposition.
#![forbid(unsafe_code)]

pub mod door;
pub mod handshake;
pub mod kv_transport;
pub mod metrics;
pub mod trust;
pub mod wire;
