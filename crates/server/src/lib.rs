//! The processes around the protocol: the gateway (HTTP API + worker registry), the
//! prefill and decode workers, and `serve`, which runs all three on one machine.
//!
//! # Layout
//! - [`gateway`]: tokio; the OpenAI API (from `bulkhead-api`) over the protocol's gateway role.
//! - [`prefill_worker`], [`decode_worker`]: blocking threads around the protocol's roles.
//! - [`worker`]: what both workers share: loading, the capacity contract (I5), registration.
//! - [`wire`]: frames over blocking TCP (or UCX), and the cluster handshake over them.
//! - [`door`]: what a connection may hold before it has proved the key (I9): the
//!   handshake deadline, the waiting room's caps and evictions, refusals by reason.
//! - [`kv_transport`]: which road a KV connection's frames take (UCX or TCP), chosen per
//!   connection over its authenticated session.
//! - [`trust`]: where the cluster key comes from, and which listeners may run without one.
//! - [`core_budget`]: decode steps first when the workers share one host's cores.
//! - [`health`]: a worker's optional liveness and readiness listener for probes.
//! - [`metrics`]: what each process counts, the workers' reports, the `/metrics` exposition.
#![forbid(unsafe_code)]

pub mod core_budget;
pub mod decode_worker;
pub mod door;
pub mod gateway;
pub mod gateways;
pub mod health;
pub mod http;
pub mod kv_transport;
pub mod metrics;
pub mod prefill_worker;
pub mod trust;
pub mod wire;
pub mod worker;
