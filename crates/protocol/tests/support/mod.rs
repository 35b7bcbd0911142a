//! What the prefill driver tests share.

use bulkhead_protocol::driver::prefill::{LinkDown, PrefillLink};
use bulkhead_protocol::{Message, WorkerId};

/// A prefill worker's transport that keeps every message, and whose KV connection never
/// goes down.
#[derive(Default)]
pub struct Recorder {
    /// Sent to the gateway, in order.
    pub gateway: Vec<Message>,
    /// Sent to the decode worker, in order.
    pub decode: Vec<Message>,
}

impl PrefillLink for Recorder {
    fn to_gateway(&mut self, msg: Message) {
        self.gateway.push(msg);
    }
    fn to_decode(&mut self, _: WorkerId, msg: Message) -> Result<(), LinkDown> {
        self.decode.push(msg);
        Ok(())
    }
    fn connect(&mut self, _: WorkerId, _: &str) {}
    fn rejoin(&mut self) {}
}
