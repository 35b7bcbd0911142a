//! KV bytes over UCX: shared memory, CMA or RDMA where the peers have one, through UCP's C
//! API loaded from `libucp.so.0` at run time (nothing needs UCX to build or to run without
//! it). This is the workspace's only FFI; `kv` and `protocol` keep `forbid(unsafe_code)`.
//!
//! What it moves is opaque: whole protocol frames, one tagged message each, from a
//! [`Sender`] (the prefill side) to a [`Receiver`] (the decode side), which hands them to
//! the same frame decoder and verifier as TCP's bytes.
//!
//! Why a late write cannot land (I4): delivery is two-sided. Each message is received
//! into a buffer the receiver moves into [`Receiver::recv`], which gives it back only when
//! UCX is done with it; a buffer of a request UCX does not give back (one that matched and
//! then stalled) is parked until the worker is destroyed, never reused. Between hosts,
//! rendezvous is receiver-driven (`RNDV_SCHEME=get_zcopy`): for large messages the receiver
//! reads from the sender's registered buffer, so the receiver never registers memory for a
//! peer and no peer ever holds a remote key to its memory, pool pages or otherwise. On one
//! host ([`Peer::SameHost`]) every message is eager, copied through shared-memory queues:
//! no memory of either side is registered at all. The receiver copies nothing into the KV pool itself: the caller
//! verifies each chunk and imports it, as for TCP.
//!
//! Threads: a [`Sender`] or [`Receiver`] owns its own UCP context and worker, the worker in
//! serialized mode (any thread, one at a time). It is `Send`, not `Sync`, and every call
//! takes it by `&mut` or by value, so one thread at a time is what the compiler enforces.
#![deny(unsafe_op_in_unsafe_fn)]

mod ffi;

use std::ffi::{CStr, CString, c_char, c_int};
use std::os::fd::RawFd;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use ffi::{Api, Handle, StatusPtr};

/// The oldest UCP with the `*_nbx` calls this crate uses.
const MIN_VERSION: (u32, u32) = (1, 10);
/// The one tag every frame is sent under: a receiver serves one sender.
const TAG: u64 = 0xb0_1c_4e_ad;
/// The longest a wait sleeps before progressing UCX anyway. UCX's shared-memory wakeups
/// travel over a Unix socket, which does not cross network namespaces (peers on one host in
/// two namespaces still share memory): without this cap such a receiver sleeps through the
/// frames that arrived.
const WAKE_CHECK: Duration = Duration::from_millis(2);
/// Most bytes of a peer's worker address accepted (UCX's own are a few hundred).
pub const MAX_ADDRESS: usize = 64 << 10;

static API: OnceLock<Result<Api, String>> = OnceLock::new();

fn api() -> Result<&'static Api, UcxError> {
    API.get_or_init(Api::load).as_ref().map_err(|e| UcxError::Load(e.clone()))
}

/// Why UCX could not be used or a transfer over it failed.
#[derive(Debug, thiserror::Error)]
pub enum UcxError {
    #[error("cannot load libucp.so.0 (install UCX, e.g. Debian's libucx0): {0}")]
    Load(String),
    #[error("UCX {0} is older than the 1.10 this needs")]
    TooOld(Version),
    #[error("{call}: {status}")]
    Call { call: &'static str, status: String },
    #[error("UCX has no transport to the peer that it may use here (shared memory, CMA or RDMA; UCX's TCP is left to Bulkhead's own)")]
    Unreachable,
    #[error("the peer's UCX address is {0} bytes (at most {MAX_ADDRESS})")]
    BadAddress(usize),
    #[error("a message of {len} bytes, over the limit of {limit}")]
    TooLarge { len: usize, limit: usize },
    #[error("the peer closed the connection")]
    PeerClosed,
    #[error("timed out after {0:?}")]
    Timeout(Duration),
    #[error("poll: {0}")]
    Poll(std::io::Error),
}

/// A UCX library version.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Version {
    pub major: u32,
    pub minor: u32,
    pub release: u32,
}

impl std::fmt::Display for Version {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.release)
    }
}

/// The UCX this process can use, or why none.
pub fn version() -> Result<Version, UcxError> {
    let api = api()?;
    let (mut major, mut minor, mut release) = (0, 0, 0);
    // SAFETY: three valid out-pointers.
    unsafe { (api.get_version)(&mut major, &mut minor, &mut release) };
    let v = Version { major, minor, release };
    if (major, minor) < MIN_VERSION {
        return Err(UcxError::TooOld(v));
    }
    Ok(v)
}

/// Which of UCX's transports a connection may use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transports {
    /// Shared memory, CMA or RDMA, not UCX's TCP (slower than Bulkhead's own framing):
    /// with nothing else to the peer, [`Sender::connect`] fails with
    /// [`UcxError::Unreachable`] and the caller keeps TCP. `UCX_TLS`, when set, wins.
    Fast,
    /// Whatever UCX picks, its TCP included.
    Any,
}

/// Where the peer runs, which decides how large messages move.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Peer {
    /// On this host: every message goes eagerly through shared memory (`RNDV_THRESH=inf`),
    /// which for page-sized KV chunks measured about three times the rate of a CMA
    /// rendezvous: no round trip per message, and the sender's copy overlaps the receiver's.
    SameHost,
    /// On another host (or where that is not known): large messages by receiver-driven
    /// rendezvous, the NIC reading the sender's buffer.
    OtherHost,
}

/// One UCP context and its one worker, used by one thread.
struct Node {
    api: &'static Api,
    context: Handle,
    worker: Handle,
    /// The worker's wakeup descriptor, for `poll`.
    efd: RawFd,
    /// Buffers of requests UCX did not give back, freed only after the worker and context
    /// are destroyed.
    parked: Vec<Vec<u8>>,
}

// SAFETY: the worker is created with UCS_THREAD_MODE_SERIALIZED, which allows any thread
// to use it one at a time; the context serves only this worker. `Node` is not `Sync`, and
// it is used only through `&mut` of its owner or `&self` within one such call, so no two
// threads use it at once. Parked buffers are plain `Vec`s.
unsafe impl Send for Node {}

/// What woke a wait.
enum Woke {
    Ucx,
    Watch,
}

impl Node {
    fn new(transports: Transports, peer: Peer) -> Result<Node, UcxError> {
        version()?;
        let api = api()?;
        let mut node = Node { api, context: std::ptr::null_mut(), worker: std::ptr::null_mut(), efd: -1, parked: Vec::new() };
        let mut config: Handle = std::ptr::null_mut();
        // SAFETY: null prefix and file mean "UCX_ from the environment"; valid out-pointer.
        node.check("ucp_config_read", unsafe { (api.config_read)(std::ptr::null(), std::ptr::null(), &mut config) })?;
        let context = node.init_context(config, transports, peer);
        // SAFETY: `config` came from ucp_config_read and is released once, after use.
        unsafe { (api.config_release)(config) };
        node.context = context?;
        let params = ffi::WorkerParams {
            field_mask: ffi::UCP_WORKER_PARAM_FIELD_THREAD_MODE,
            thread_mode: ffi::UCS_THREAD_MODE_SERIALIZED,
            rest: [0; 47],
        };
        // SAFETY: a live context; params valid for the call.
        let s = unsafe { (api.worker_create)(node.context, &params, &mut node.worker) };
        node.check("ucp_worker_create", s)?;
        // SAFETY: a live worker of a context created with UCP_FEATURE_WAKEUP.
        let s = unsafe { (api.worker_get_efd)(node.worker, &mut node.efd) };
        node.check("ucp_worker_get_efd", s)?;
        Ok(node)
    }

    fn init_context(&self, config: Handle, transports: Transports, peer: Peer) -> Result<Handle, UcxError> {
        let modify = |name: &str, value: &str| -> Result<(), UcxError> {
            let (n, v) = (cstring(name), cstring(value));
            // SAFETY: a live config and two NUL-terminated strings that outlive the call.
            self.check("ucp_config_modify", unsafe { (self.api.config_modify)(config, n.as_ptr(), v.as_ptr()) })
        };
        if transports == Transports::Fast && std::env::var_os("UCX_TLS").is_none() {
            modify("TLS", "^tcp")?;
        }
        // Receiver-driven rendezvous: no peer is ever given a key to this side's memory.
        modify("RNDV_SCHEME", "get_zcopy")?;
        if peer == Peer::SameHost && std::env::var_os("UCX_RNDV_THRESH").is_none() {
            modify("RNDV_THRESH", "inf")?;
        }
        let params = ffi::Params {
            field_mask: ffi::UCP_PARAM_FIELD_FEATURES,
            features: ffi::UCP_FEATURE_TAG | ffi::UCP_FEATURE_WAKEUP,
            rest: [0; 8],
        };
        let mut context: Handle = std::ptr::null_mut();
        // SAFETY: params and config valid for the call; valid out-pointer.
        let s = unsafe { (self.api.init_version)(MIN_VERSION.0, MIN_VERSION.1, &params, config, &mut context) };
        self.check("ucp_init", s)?;
        Ok(context)
    }

    fn check(&self, call: &'static str, s: ffi::Status) -> Result<(), UcxError> {
        match s {
            ffi::UCS_OK => Ok(()),
            ffi::UCS_ERR_UNREACHABLE => Err(UcxError::Unreachable),
            s => Err(UcxError::Call { call, status: self.status_text(s) }),
        }
    }

    fn status_text(&self, s: ffi::Status) -> String {
        // SAFETY: ucs_status_string returns a static NUL-terminated string for any value.
        let p = unsafe { (self.api.status_string)(s) };
        if p.is_null() {
            return format!("status {s}");
        }
        // SAFETY: non-null, static, NUL-terminated (above).
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }

    fn address(&self) -> Result<Vec<u8>, UcxError> {
        let mut a: Handle = std::ptr::null_mut();
        let mut len = 0usize;
        // SAFETY: a live worker; valid out-pointers.
        self.check("ucp_worker_get_address", unsafe { (self.api.worker_get_address)(self.worker, &mut a, &mut len) })?;
        // SAFETY: UCX gave `len` readable bytes at `a`, copied before release.
        let address = unsafe { std::slice::from_raw_parts(a as *const u8, len) }.to_vec();
        // SAFETY: the address this worker gave, released once.
        unsafe { (self.api.worker_release_address)(self.worker, a) };
        Ok(address)
    }

    fn endpoint(&self, address: &[u8]) -> Result<Endpoint, UcxError> {
        check_address(address)?;
        let params = ffi::EpParams {
            // No peer-failure mode: UCX 1.13's shared-memory transports do not support it. A
            // peer that goes away is seen on the control connection instead.
            field_mask: ffi::UCP_EP_PARAM_FIELD_REMOTE_ADDRESS,
            address: address.as_ptr().cast(),
            err_mode: 0,
            err_handler_cb: std::ptr::null_mut(),
            err_handler_arg: std::ptr::null_mut(),
            user_data: std::ptr::null_mut(),
            flags: 0,
            rest: [0; 13],
        };
        let mut ep: Handle = std::ptr::null_mut();
        // SAFETY: a live worker; `address` is read during the call only; valid out-pointer.
        self.check("ucp_ep_create", unsafe { (self.api.ep_create)(self.worker, &params, &mut ep) })?;
        Ok(Endpoint { api: self.api, worker: self.worker, ep })
    }

    fn progress(&self) {
        // SAFETY: a live worker, used by one thread at a time (see `impl Send for Node`).
        while unsafe { (self.api.worker_progress)(self.worker) } != 0 {}
    }

    /// Sleep until UCX has something to progress, `watch` has one of its events, or
    /// `timeout` passes (`None`: no limit), [`WAKE_CHECK`] at most. Spurious wakeups are
    /// fine: callers re-check.
    fn wait(&self, watch: Option<(RawFd, i16)>, timeout: Option<Duration>) -> Result<Woke, UcxError> {
        // SAFETY: a live worker of a context created with UCP_FEATURE_WAKEUP.
        match unsafe { (self.api.worker_arm)(self.worker) } {
            ffi::UCS_OK => {}
            ffi::UCS_ERR_BUSY => return Ok(Woke::Ucx),
            s => return Err(UcxError::Call { call: "ucp_worker_arm", status: self.status_text(s) }),
        }
        let (fd, events) = watch.unwrap_or((-1, 0));
        let mut fds = [libc::pollfd { fd: self.efd, events: libc::POLLIN, revents: 0 }, libc::pollfd { fd, events, revents: 0 }];
        let ms = timeout.map_or(WAKE_CHECK, |d| d.min(WAKE_CHECK)).as_millis().max(1) as c_int;
        // SAFETY: two valid pollfd entries (a negative fd is ignored by poll).
        if unsafe { libc::poll(fds.as_mut_ptr(), 2, ms) } < 0 {
            let e = std::io::Error::last_os_error();
            return if e.kind() == std::io::ErrorKind::Interrupted { Ok(Woke::Ucx) } else { Err(UcxError::Poll(e)) };
        }
        Ok(if fds[1].revents != 0 { Woke::Watch } else { Woke::Ucx })
    }

    /// Drive the request behind `p`, which uses `buf`, to its end within `timeout`, giving
    /// up if `watch` fires. Gives `buf` back once UCX is done with it; if UCX is not
    /// (a send cannot be cancelled, nor a receive that matched), `buf` is parked until the
    /// worker is destroyed ([`Node::park`]).
    fn complete(&mut self, p: Handle, buf: Vec<u8>, watch: Option<(RawFd, i16)>, timeout: Duration) -> Result<Vec<u8>, UcxError> {
        let deadline = Instant::now() + timeout;
        let req = match ffi::status_ptr(p) {
            StatusPtr::Done => return Ok(buf),
            StatusPtr::Failed(s) => return self.check("request", s).map(|()| buf),
            StatusPtr::Pending(req) => req,
        };
        loop {
            self.progress();
            // SAFETY: a request UCX returned and nobody has freed.
            let s = unsafe { (self.api.request_check_status)(req) };
            if s != ffi::UCS_INPROGRESS {
                // SAFETY: complete, freed once.
                unsafe { (self.api.request_free)(req) };
                return self.check("request", s).map(|()| buf);
            }
            let now = Instant::now();
            if now >= deadline {
                self.park(req, buf);
                return Err(UcxError::Timeout(timeout));
            }
            if let Woke::Watch = self.wait(watch, Some(deadline - now))? {
                self.park(req, buf);
                return Err(UcxError::PeerClosed);
            }
        }
    }

    /// Give up on a running request: cancel it, and if UCX does not give it back at once,
    /// keep its buffer alive until the worker (and with it every transport operation that
    /// could still read or write the buffer) is destroyed.
    fn park(&mut self, req: Handle, buf: Vec<u8>) {
        // SAFETY: a live request of this worker (cancelling a send is a no-op).
        unsafe { (self.api.request_cancel)(self.worker, req) };
        self.progress();
        // SAFETY: as above; not yet freed.
        if unsafe { (self.api.request_check_status)(req) } != ffi::UCS_INPROGRESS {
            // SAFETY: complete (cancelled), freed once.
            unsafe { (self.api.request_free)(req) };
            return;
        }
        self.parked.push(buf);
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        // SAFETY: each handle is live if non-null, destroyed once, worker before context.
        unsafe {
            if !self.worker.is_null() {
                (self.api.worker_destroy)(self.worker);
            }
            if !self.context.is_null() {
                (self.api.cleanup)(self.context);
            }
        }
        // Only now can nothing touch them.
        self.parked.clear();
    }
}

/// Refuse an address UCX should not be asked to parse (empty, or far larger than any real one).
fn check_address(address: &[u8]) -> Result<(), UcxError> {
    if address.is_empty() || address.len() > MAX_ADDRESS {
        return Err(UcxError::BadAddress(address.len()));
    }
    Ok(())
}

fn cstring(s: &str) -> CString {
    // Our own constants, which hold no NUL.
    CString::new(s).unwrap_or_default()
}

/// The receiving end (decode side) of one connection.
pub struct Receiver {
    /// The endpoint back to the sender (never sent on); declared first, so it closes
    /// before the worker goes.
    back: Option<Endpoint>,
    node: Node,
    address: Vec<u8>,
}

/// What [`Receiver::recv`] got.
#[derive(Debug, PartialEq, Eq)]
pub enum Received {
    /// A whole message, in the buffer given.
    Message(Vec<u8>),
    /// The watched descriptor became readable (data or end of stream) first.
    Watch,
}

impl Receiver {
    /// A new worker to receive on; its [`Receiver::address`] goes to the sender.
    pub fn new(transports: Transports, peer: Peer) -> Result<Receiver, UcxError> {
        let node = Node::new(transports, peer)?;
        let address = node.address()?;
        Ok(Receiver { back: None, node, address })
    }

    /// Open the endpoint back to the sender whose [`Sender::address`] is `address`. UCX
    /// needs one on each side between network namespaces (its shared-memory wireup does not
    /// complete there with one); nothing is ever sent on it.
    pub fn connect_back(&mut self, address: &[u8]) -> Result<(), UcxError> {
        self.back = Some(self.node.endpoint(address)?);
        Ok(())
    }

    /// This worker's address, for the sender (over the authenticated control session only:
    /// UCX parses it in C).
    pub fn address(&self) -> &[u8] {
        &self.address
    }

    /// Wait for the next message and receive it into `buf` (resized to its length), or
    /// return [`Received::Watch`] as soon as `watch` is readable (the control connection
    /// ended, or sent what it should not). A message over `limit` bytes is an error, and the
    /// connection must close.
    pub fn recv(&mut self, watch: RawFd, limit: usize, timeout: Duration, mut buf: Vec<u8>) -> Result<Received, UcxError> {
        let watch = Some((watch, libc::POLLIN));
        loop {
            self.node.progress();
            let mut info = ffi::TagRecvInfo { sender_tag: 0, length: 0 };
            // SAFETY: a live worker; valid out-pointer; remove=1 takes the message.
            let msg = unsafe { (self.node.api.tag_probe_nb)(self.node.worker, TAG, u64::MAX, 1, &mut info) };
            if !msg.is_null() {
                let len = info.length;
                if len > limit {
                    return Err(UcxError::TooLarge { len, limit });
                }
                buf.resize(len, 0);
                // SAFETY: `buf` has room for `len` bytes and moves into `complete`, which
                // gives it back only once UCX is done with the request (or parks it).
                let p = unsafe {
                    (self.node.api.tag_msg_recv_nbx)(self.node.worker, buf.as_mut_ptr().cast(), len, msg, &ffi::RequestParam::none())
                };
                return self.node.complete(p, buf, watch, timeout).map(Received::Message);
            }
            if let Woke::Watch = self.node.wait(watch, None)? {
                return Ok(Received::Watch);
            }
        }
    }
}

/// The sending end (prefill side) of one connection.
pub struct Sender {
    // Field order: the endpoint closes before the worker is destroyed.
    ep: Endpoint,
    node: Node,
    address: Vec<u8>,
}

impl Sender {
    /// Connect to the receiver whose [`Receiver::address`] is `address`.
    pub fn connect(address: &[u8], transports: Transports, peer: Peer) -> Result<Sender, UcxError> {
        // Before any UCX is loaded, so a bad address says so even where there is none.
        check_address(address)?;
        let node = Node::new(transports, peer)?;
        let ep = node.endpoint(address)?;
        let address = node.address()?;
        Ok(Sender { node, ep, address })
    }

    /// This worker's address, for the receiver's [`Receiver::connect_back`].
    pub fn address(&self) -> &[u8] {
        &self.address
    }

    /// Send one message and wait until UCX is done with it, then give its buffer back;
    /// give up after `timeout`, or when `watch` (the control connection) reports the peer
    /// gone. Done is not delivered: an eager message can still be on its way, and
    /// dropping the sender (or ending the control connection) right after can lose it,
    /// which the protocol sees as a cut link (pages quarantined until the fence).
    pub fn send(&mut self, bytes: Vec<u8>, watch: RawFd, timeout: Duration) -> Result<Vec<u8>, UcxError> {
        // SAFETY: a live endpoint; `bytes` moves into `complete`, which gives it back only
        // once UCX is done with the request (or parks it).
        let p = unsafe { (self.node.api.tag_send_nbx)(self.ep.ep, bytes.as_ptr().cast(), bytes.len(), TAG, &ffi::RequestParam::none()) };
        self.node.complete(p, bytes, Some((watch, libc::POLLRDHUP)), timeout)
    }

    /// The UCX transports this endpoint's lanes use, such as `cma/memory,posix/memory`
    /// (from `ucp_ep_print_info`; wireup may add lanes after the first messages).
    pub fn transports(&self) -> String {
        let mut buf: *mut c_char = std::ptr::null_mut();
        let mut size = 0usize;
        // SAFETY: valid out-pointers; the stream is closed before `buf` is read, and `buf`
        // freed once.
        let text = unsafe {
            let f = libc::open_memstream(&mut buf, &mut size);
            if f.is_null() {
                return "unknown".into();
            }
            (self.node.api.ep_print_info)(self.ep.ep, f);
            libc::fclose(f);
            let text = if buf.is_null() { String::new() } else { CStr::from_ptr(buf).to_string_lossy().into_owned() };
            libc::free(buf.cast());
            text
        };
        lanes(&text)
    }
}

/// An endpoint of a node's worker, force-closed on drop (before the worker: owners keep it
/// in a field declared before their `Node`).
struct Endpoint {
    api: &'static Api,
    worker: Handle,
    ep: Handle,
}

// SAFETY: an endpoint belongs to one node's worker and is owned beside it (in a Sender or
// Receiver), used under the same one-thread-at-a-time rule as `Node`; not Sync.
unsafe impl Send for Endpoint {}

impl Drop for Endpoint {
    fn drop(&mut self) {
        let mut p = ffi::RequestParam::none();
        p.op_attr_mask = ffi::UCP_OP_ATTR_FIELD_FLAGS;
        p.flags = ffi::UCP_EP_CLOSE_FLAG_FORCE;
        // SAFETY: a live endpoint, closed once; no buffer of ours is involved.
        let r = unsafe { (self.api.ep_close_nbx)(self.ep, &p) };
        if let StatusPtr::Pending(req) = ffi::status_ptr(r) {
            let until = Instant::now() + Duration::from_secs(1);
            // SAFETY: a live request until freed; freeing an unfinished one lets UCX release
            // it when it completes (ucp_request_free), before the worker is destroyed.
            unsafe {
                while (self.api.request_check_status)(req) == ffi::UCS_INPROGRESS && Instant::now() < until {
                    while (self.api.worker_progress)(self.worker) != 0 {}
                }
                (self.api.request_free)(req);
            }
        }
    }
}

/// The distinct `transport/device` names in `ucp_ep_print_info`'s lane lines
/// (`lane[1]:  5:cma/memory.0 md[4] ...` gives `cma/memory`).
fn lanes(info: &str) -> String {
    let mut out: Vec<&str> = Vec::new();
    for line in info.lines() {
        let Some(rest) = line.split_once("lane[").and_then(|(_, r)| r.split_once("]:")).map(|(_, r)| r.trim_start()) else { continue };
        let Some(tl) = rest.split_whitespace().next().and_then(|t| t.split_once(':')).map(|(_, t)| t) else { continue };
        let tl = tl.rsplit_once('.').map_or(tl, |(name, _)| name);
        if !out.contains(&tl) {
            out.push(tl);
        }
    }
    if out.is_empty() { "unknown".into() } else { out.join(",") }
}

#[cfg(test)]
mod tests {
    #[test]
    fn lane_names_from_the_endpoint_info() {
        let info = "#                 lane[0]:  0:self/memory0.0 md[0]          -> md[0]/self/sysdev[255] am am_bw#0\n\
                    #                 lane[1]:  5:cma/memory.0 md[4]            -> md[4]/cma/sysdev[255] rma_bw#0\n\
                    #                 lane[2]:  5:cma/memory.0 md[4]            -> md[4]/cma/sysdev[255] rma_bw#1\n\
                    #                tag_send: 0..<egr/short>..8185..<egr/bcopy>..8192..<rndv>..(inf)\n";
        assert_eq!(super::lanes(info), "self/memory0,cma/memory");
        assert_eq!(super::lanes("nothing"), "unknown");
    }
}
