//! Request ids and where workers' messages go: a client request's id names the gateway
//! that made it, an attempt's id adds the attempt's number in its high bits, and a worker
//! sends a request's messages to that gateway only.

use bulkhead_kv::RequestId;

use crate::msg::{GatewayId, Message};

/// Where a client request id holds its gateway ([`GatewayId`]): the 8 bits below
/// [`CLIENT_ID_LIMIT`]'s.
const GATEWAY_SHIFT: u32 = 40;

/// Client request ids must stay below this; the bits above hold the attempt number.
pub const CLIENT_ID_LIMIT: u64 = 1 << 48;

/// The id of the `n`th client request (from 1) of gateway `gateway`: its number in the
/// low 40 bits, the gateway above them. Gateway 0's ids are its numbers.
pub fn request_id(gateway: GatewayId, n: u64) -> RequestId {
    RequestId((u64::from(gateway.0) << GATEWAY_SHIFT) | (n % (1 << GATEWAY_SHIFT)))
}

/// A request's number at its gateway (its attempts share it).
pub fn request_number(req: RequestId) -> u64 {
    req.0 % (1 << GATEWAY_SHIFT)
}

/// The gateway a request (or an attempt of it) came from: its messages go there.
pub fn gateway_of(req: RequestId) -> GatewayId {
    GatewayId(((req.0 % CLIENT_ID_LIMIT) >> GATEWAY_SHIFT) as u8)
}

/// Where a worker's message to "the gateway" goes, among the gateways it is registered
/// with (each given with what the caller writes to it through, `T`): a request's message
/// (any attempt's) to the gateway that made the request ([`gateway_of`]) only, or nowhere
/// when that gateway is not among them (its requests on the worker were ended with its
/// connection); anything else (load, cache reports, room) to every one, in their order.
/// The worker's gateway links, the fault schedules and the model checker all route by it.
pub fn gateways_for<T, I>(msg: &Message, registered: I) -> impl Iterator<Item = T> + use<T, I>
where
    I: IntoIterator<Item = (GatewayId, T)>,
{
    let to = msg.req().map(gateway_of);
    registered.into_iter().filter(move |(g, _)| to.is_none_or(|t| t == *g)).map(|(_, t)| t)
}

/// The id workers know attempt `n` (0 = the first) of client request `client` by.
pub fn attempt_id(client: RequestId, n: u32) -> RequestId {
    RequestId((client.0 % CLIENT_ID_LIMIT) | (u64::from(n) << 48))
}

/// The client request an attempt id belongs to.
pub fn client_of(attempt: RequestId) -> RequestId {
    RequestId(attempt.0 % CLIENT_ID_LIMIT)
}
