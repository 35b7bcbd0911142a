//! The wire format: length-prefixed, versioned frames with a bounded size.
//!
//! ```text
//! frame   = magic "BH" (2) | version u8 | kind u8 | payload length u32 LE | payload
//!           [ | MAC (16), after a handshake: keyed BLAKE3 of sequence number and frame ]
//! payload = fields of the message, little-endian; strings and lists as u32 count + items
//! ```
//!
//! Decoding is sans-IO ([`FrameDecoder`]: bytes in, messages out). Bad magic, another
//! version, an unknown kind, a payload over the limit, a truncated or over-long payload, an
//! invalid enum value or invalid UTF-8 are errors: the caller closes that connection (and
//! counts it); nothing is guessed.

use bulkhead_kv::{ChunkHeader, Generation, PageId, PageKey, PageRef, RequestId};

use crate::cache::CacheScope;

use crate::auth::{AuthError, Opener, Sealer, TAG_LEN};
use crate::msg::*;
use crate::payload::PayloadPool;
use std::ops::Range;
use std::sync::Arc;

/// Protocol version spoken by this build (2: `Sampling` carries `ignore_eos`; 3: `Reserve`
/// and `Prefill` carry a `TraceContext`, workers send `Metrics`; 4: `KvKeepalive`;
/// 5: `Finished` may say `abort`; 6: KV on demand: `Retracted`, `Reserve.resume`,
/// `Prefill.skip_draws`, `PeerLeft` for prefill workers that reconnect, and `Room`;
/// 7: the cluster handshake (`AuthHello`, `AuthChallenge`, `AuthProof`, `AuthRefused`)
/// and a 16-byte MAC after every frame that follows it; 8: both sides of the handshake say
/// whether they want encryption, and an encrypted session's payloads are AES-256-GCM;
/// 9: prefix-cache scopes and reports; 10: `Sampling` carries penalties, `logit_bias`,
/// `min_p`, `min_tokens`, `stop_token_ids`, log-probabilities and a grammar, `Token` and
/// `Done` carry log-probabilities, `Reserve` the client's prompt);
/// 11: the KV transport is negotiated after `KvHello` (`KvUcxAddress`, `KvUcxUse`);
/// 12: the decode side's cache: `Reserve.cache`, `Reserved.held`, `Prefill.held`;
/// 13: `Reserved.local`, a short rest computed on the decode worker).
pub const VERSION: u8 = 14;
/// Default largest payload accepted (a KV chunk of one page is ~370 KB for the default model).
pub const DEFAULT_MAX_FRAME: usize = 16 << 20;
const MAGIC: [u8; 2] = *b"BH";
const HEADER: usize = 8;

/// Why bytes could not be decoded. The connection they came from must be closed.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CodecError {
    #[error("bad magic {0:02x?}")]
    BadMagic([u8; 2]),
    #[error("protocol version {0}, this build speaks {VERSION}")]
    Version(u8),
    #[error("unknown message kind {0}")]
    UnknownKind(u8),
    #[error("frame of {len} bytes exceeds the limit of {max}")]
    TooLarge { len: usize, max: usize },
    #[error("message truncated: {0}")]
    Truncated(&'static str),
    #[error("{0} trailing bytes after the message")]
    Trailing(usize),
    #[error("invalid value {value} for {field}")]
    Invalid { field: &'static str, value: u64 },
    #[error("invalid UTF-8 in {0}")]
    Utf8(&'static str),
    #[error(transparent)]
    Auth(#[from] AuthError),
}

struct W<'a>(&'a mut Vec<u8>);

impl W<'_> {
    fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn f32(&mut self, v: f32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn f64(&mut self, v: f64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn bytes(&mut self, b: &[u8]) {
        self.u32(b.len() as u32);
        self.0.extend_from_slice(b);
    }
    fn str(&mut self, s: &str) {
        self.bytes(s.as_bytes());
    }
    fn req(&mut self, r: RequestId) {
        self.u64(r.0);
    }
    fn tokens(&mut self, t: &[u32]) {
        self.u32(t.len() as u32);
        t.iter().for_each(|t| self.u32(*t));
    }
    fn pages(&mut self, p: &[PageRef]) {
        self.u32(p.len() as u32);
        for r in p {
            self.u32(r.page.0);
            self.u64(r.generation.0);
        }
    }
    fn keys(&mut self, k: &[PageKey]) {
        self.u32(k.len() as u32);
        k.iter().for_each(|k| self.0.extend_from_slice(&k.0));
    }
    fn scope(&mut self, s: &Option<CacheScope>) {
        self.u8(u8::from(s.is_some()));
        if let Some(s) = s {
            self.0.extend_from_slice(&s.0);
        }
    }
    fn trace(&mut self, t: &TraceContext) {
        self.0.extend_from_slice(&t.trace_id);
        self.str(&t.request_id);
        self.str(&t.tenant);
    }
    fn families(&mut self, fs: &[MetricFamily]) {
        self.u32(fs.len() as u32);
        for f in fs {
            self.str(&f.name);
            self.str(&f.help);
            self.u8(f.kind as u8);
            self.u32(f.samples.len() as u32);
            for s in &f.samples {
                self.str(&s.name);
                self.u32(s.labels.len() as u32);
                for (k, v) in &s.labels {
                    self.str(k);
                    self.str(v);
                }
                self.f64(s.value);
            }
        }
    }
    fn sampling(&mut self, s: &Sampling) {
        self.f32(s.temperature);
        self.u32(s.top_k);
        self.f32(s.top_p);
        self.f32(s.min_p);
        self.u8(u8::from(s.seed.is_some()));
        self.u64(s.seed.unwrap_or(0));
        self.u8(u8::from(s.ignore_eos));
        self.u8(u8::from(s.skip_special_tokens));
        self.f32(s.presence_penalty);
        self.f32(s.frequency_penalty);
        self.f32(s.repetition_penalty);
        self.u32(s.logit_bias.len() as u32);
        for &(t, b) in &s.logit_bias {
            self.u32(t);
            self.f32(b);
        }
        self.u32(s.min_tokens);
        self.tokens(&s.stop_token_ids);
        // 0 = off, else 1 + the number of alternatives.
        self.u8(s.logprobs.map_or(0, |n| n.saturating_add(1)));
        match &s.grammar {
            None => self.u8(0),
            Some(GrammarSpec::JsonObject) => self.u8(1),
            Some(GrammarSpec::JsonSchema(t)) => {
                self.u8(2);
                self.str(t);
            }
            Some(GrammarSpec::Regex(t)) => {
                self.u8(3);
                self.str(t);
            }
            Some(GrammarSpec::Choice(c)) => {
                self.u8(4);
                self.u32(c.len() as u32);
                c.iter().for_each(|c| self.str(c));
            }
            Some(GrammarSpec::Lark(t)) => {
                self.u8(5);
                self.str(t);
            }
        }
    }
    fn logprobs(&mut self, l: &Option<TokenLogprobs>) {
        self.u8(u8::from(l.is_some()));
        if let Some(l) = l {
            self.f32(l.logprob);
            self.u32(l.top.len() as u32);
            for &(t, lp) in &l.top {
                self.u32(t);
                self.f32(lp);
            }
        }
    }
}

struct R<'a> {
    b: &'a [u8],
    what: &'static str,
}

impl<'a> R<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], CodecError> {
        if self.b.len() < n {
            return Err(CodecError::Truncated(self.what));
        }
        let (h, t) = self.b.split_at(n);
        self.b = t;
        Ok(h)
    }
    fn arr<const N: usize>(&mut self) -> Result<[u8; N], CodecError> {
        let mut a = [0; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }
    fn u8(&mut self) -> Result<u8, CodecError> {
        Ok(self.arr::<1>()?[0])
    }
    fn u32(&mut self) -> Result<u32, CodecError> {
        Ok(u32::from_le_bytes(self.arr()?))
    }
    fn u64(&mut self) -> Result<u64, CodecError> {
        Ok(u64::from_le_bytes(self.arr()?))
    }
    fn f32(&mut self) -> Result<f32, CodecError> {
        Ok(f32::from_le_bytes(self.arr()?))
    }
    fn f64(&mut self) -> Result<f64, CodecError> {
        Ok(f64::from_le_bytes(self.arr()?))
    }
    fn bytes(&mut self) -> Result<&'a [u8], CodecError> {
        let n = self.u32()? as usize;
        self.take(n)
    }
    fn str(&mut self, field: &'static str) -> Result<String, CodecError> {
        String::from_utf8(self.bytes()?.to_vec()).map_err(|_| CodecError::Utf8(field))
    }
    fn req(&mut self) -> Result<RequestId, CodecError> {
        Ok(RequestId(self.u64()?))
    }
    /// A count of items of at least `min_size` bytes each, checked against what remains.
    fn count(&mut self, min_size: usize) -> Result<usize, CodecError> {
        let n = self.u32()? as usize;
        if n.saturating_mul(min_size) > self.b.len() {
            return Err(CodecError::Truncated(self.what));
        }
        Ok(n)
    }
    fn tokens(&mut self) -> Result<Vec<u32>, CodecError> {
        let n = self.count(4)?;
        (0..n).map(|_| self.u32()).collect()
    }
    fn pages(&mut self) -> Result<Vec<PageRef>, CodecError> {
        let n = self.count(12)?;
        (0..n).map(|_| Ok(PageRef { page: PageId(self.u32()?), generation: Generation(self.u64()?) })).collect()
    }
    fn keys(&mut self) -> Result<Vec<PageKey>, CodecError> {
        let n = self.count(16)?;
        (0..n).map(|_| Ok(PageKey(self.arr()?))).collect()
    }
    fn scope(&mut self) -> Result<Option<CacheScope>, CodecError> {
        Ok(if self.enum_u8("cache scope flag", flag)? { Some(CacheScope(self.arr()?)) } else { None })
    }
    fn trace(&mut self) -> Result<TraceContext, CodecError> {
        Ok(TraceContext { trace_id: self.arr()?, request_id: self.str("request_id")?, tenant: self.str("tenant")? })
    }
    fn families(&mut self) -> Result<Vec<MetricFamily>, CodecError> {
        // Minimum encoded sizes: family = name, help, kind, sample count; sample = name,
        // label count, value; label = two strings.
        let n = self.count(13)?;
        (0..n)
            .map(|_| {
                let name = self.str("metric name")?;
                let help = self.str("metric help")?;
                let kind = self.enum_u8("metric kind", metric_kind)?;
                let n = self.count(16)?;
                let samples = (0..n)
                    .map(|_| {
                        let name = self.str("sample name")?;
                        let n = self.count(8)?;
                        let labels =
                            (0..n).map(|_| Ok((self.str("label name")?, self.str("label value")?))).collect::<Result<_, CodecError>>()?;
                        Ok(MetricSample { name, labels, value: self.f64()? })
                    })
                    .collect::<Result<_, CodecError>>()?;
                Ok(MetricFamily { name, help, kind, samples })
            })
            .collect()
    }
    fn sampling(&mut self) -> Result<Sampling, CodecError> {
        let temperature = self.f32()?;
        let top_k = self.u32()?;
        let top_p = self.f32()?;
        let min_p = self.f32()?;
        // One message, one encoding: the flag is 0 or 1 and an absent seed is sent as 0.
        let seed = match (self.enum_u8("seed flag", flag)?, self.u64()?) {
            (true, seed) => Some(seed),
            (false, 0) => None,
            (false, value) => return Err(CodecError::Invalid { field: "seed", value }),
        };
        let ignore_eos = self.enum_u8("ignore_eos", flag)?;
        let skip_special_tokens = self.enum_u8("skip_special_tokens", flag)?;
        let (presence_penalty, frequency_penalty, repetition_penalty) = (self.f32()?, self.f32()?, self.f32()?);
        let n = self.count(8)?;
        let logit_bias = (0..n).map(|_| Ok((self.u32()?, self.f32()?))).collect::<Result<_, CodecError>>()?;
        let min_tokens = self.u32()?;
        let stop_token_ids = self.tokens()?;
        let logprobs = self.u8()?.checked_sub(1);
        let grammar = match self.u8()? {
            0 => None,
            1 => Some(GrammarSpec::JsonObject),
            2 => Some(GrammarSpec::JsonSchema(self.str("json schema")?)),
            3 => Some(GrammarSpec::Regex(self.str("regex")?)),
            4 => {
                let n = self.count(4)?;
                Some(GrammarSpec::Choice((0..n).map(|_| self.str("choice")).collect::<Result<_, _>>()?))
            }
            5 => Some(GrammarSpec::Lark(self.str("grammar")?)),
            v => return Err(CodecError::Invalid { field: "grammar kind", value: v.into() }),
        };
        Ok(Sampling {
            temperature,
            top_k,
            top_p,
            min_p,
            seed,
            ignore_eos,
            skip_special_tokens,
            presence_penalty,
            frequency_penalty,
            repetition_penalty,
            logit_bias,
            min_tokens,
            stop_token_ids,
            logprobs,
            grammar,
        })
    }
    fn logprobs(&mut self) -> Result<Option<TokenLogprobs>, CodecError> {
        if !self.enum_u8("logprobs flag", flag)? {
            return Ok(None);
        }
        let logprob = self.f32()?;
        let n = self.count(8)?;
        let top = (0..n).map(|_| Ok((self.u32()?, self.f32()?))).collect::<Result<_, CodecError>>()?;
        Ok(Some(TokenLogprobs { logprob, top }))
    }
    fn enum_u8<T>(&mut self, field: &'static str, f: impl Fn(u8) -> Option<T>) -> Result<T, CodecError> {
        let v = self.u8()?;
        f(v).ok_or(CodecError::Invalid { field, value: v.into() })
    }
}

fn flag(v: u8) -> Option<bool> {
    [false, true].get(usize::from(v)).copied()
}
fn purpose(v: u8) -> Option<Purpose> {
    [Purpose::Control, Purpose::Kv].get(usize::from(v)).copied()
}
fn role(v: u8) -> Option<Role> {
    [Role::Prefill, Role::Decode].get(usize::from(v)).copied()
}
fn reject(v: u8) -> Option<RejectReason> {
    use RejectReason::*;
    [ContextLength, Capacity, Duplicate, Invalid].get(usize::from(v)).copied()
}
fn fail(v: u8) -> Option<FailReason> {
    use FailReason::*;
    [TransferRefused, Timeout, WorkerLost, Internal].get(usize::from(v)).copied()
}
fn abort(v: u8) -> Option<AbortReason> {
    use AbortReason::*;
    [ClientGone, Timeout, Failed, Shutdown].get(usize::from(v)).copied()
}
fn finish(v: u8) -> Option<FinishReason> {
    use FinishReason::*;
    [Stop, Length, Abort].get(usize::from(v)).copied()
}
fn metric_kind(v: u8) -> Option<MetricKind> {
    [MetricKind::Counter, MetricKind::Gauge, MetricKind::Histogram].get(usize::from(v)).copied()
}

// The message table: each message's kind number and fields, declared once. `encode`,
// `decode_payload` and `Message::kind_name` are generated from it, so a message cannot be
// added to one side of the codec and not the other, and each field is read in the order
// it is written (a struct expression evaluates its fields in the order written).

/// A field's bytes on the wire, written and read by one impl so both directions agree.
trait Wire: Sized {
    fn put(&self, w: &mut W<'_>);
    /// `field` names it in errors.
    fn get(r: &mut R<'_>, field: &'static str) -> Result<Self, CodecError>;
}

/// Types whose bytes `W` and `R` already write and read with a method of one name.
macro_rules! wire_by_method {
    ($($t:ty => $put:ident, $get:ident;)*) => {$(
        impl Wire for $t {
            fn put(&self, w: &mut W<'_>) {
                w.$put(self);
            }
            fn get(r: &mut R<'_>, _: &'static str) -> Result<Self, CodecError> {
                r.$get()
            }
        }
    )*};
}
wire_by_method! {
    Vec<u32> => tokens, tokens;
    Vec<PageRef> => pages, pages;
    Vec<PageKey> => keys, keys;
    Vec<MetricFamily> => families, families;
    Option<CacheScope> => scope, scope;
    Option<TokenLogprobs> => logprobs, logprobs;
    Sampling => sampling, sampling;
    TraceContext => trace, trace;
}

impl Wire for u32 {
    fn put(&self, w: &mut W<'_>) {
        w.u32(*self);
    }
    fn get(r: &mut R<'_>, _: &'static str) -> Result<Self, CodecError> {
        r.u32()
    }
}

impl Wire for u64 {
    fn put(&self, w: &mut W<'_>) {
        w.u64(*self);
    }
    fn get(r: &mut R<'_>, _: &'static str) -> Result<Self, CodecError> {
        r.u64()
    }
}

impl Wire for bool {
    fn put(&self, w: &mut W<'_>) {
        w.u8(u8::from(*self));
    }
    fn get(r: &mut R<'_>, field: &'static str) -> Result<Self, CodecError> {
        r.enum_u8(field, flag)
    }
}

impl Wire for String {
    fn put(&self, w: &mut W<'_>) {
        w.str(self);
    }
    fn get(r: &mut R<'_>, field: &'static str) -> Result<Self, CodecError> {
        r.str(field)
    }
}

impl Wire for RequestId {
    fn put(&self, w: &mut W<'_>) {
        w.req(*self);
    }
    fn get(r: &mut R<'_>, _: &'static str) -> Result<Self, CodecError> {
        r.req()
    }
}

impl Wire for WorkerId {
    fn put(&self, w: &mut W<'_>) {
        w.u32(self.0);
    }
    fn get(r: &mut R<'_>, _: &'static str) -> Result<Self, CodecError> {
        Ok(WorkerId(r.u32()?))
    }
}

impl Wire for GatewayId {
    fn put(&self, w: &mut W<'_>) {
        w.u8(self.0);
    }
    fn get(r: &mut R<'_>, _: &'static str) -> Result<Self, CodecError> {
        Ok(GatewayId(r.u8()?))
    }
}

impl<const N: usize> Wire for [u8; N] {
    fn put(&self, w: &mut W<'_>) {
        w.0.extend_from_slice(self);
    }
    fn get(r: &mut R<'_>, _: &'static str) -> Result<Self, CodecError> {
        r.arr()
    }
}

/// Opaque bytes (a UCX worker address).
impl Wire for Vec<u8> {
    fn put(&self, w: &mut W<'_>) {
        w.bytes(self);
    }
    fn get(r: &mut R<'_>, _: &'static str) -> Result<Self, CodecError> {
        Ok(r.bytes()?.to_vec())
    }
}

impl Wire for Vec<String> {
    fn put(&self, w: &mut W<'_>) {
        w.u32(self.len() as u32);
        self.iter().for_each(|s| w.str(s));
    }
    fn get(r: &mut R<'_>, field: &'static str) -> Result<Self, CodecError> {
        let n = r.count(4)?;
        (0..n).map(|_| r.str(field)).collect()
    }
}

/// One-byte enums: the variant's number, and the table that reads it back.
macro_rules! wire_u8_enum {
    ($($t:ty => $of:ident),* $(,)?) => {$(
        impl Wire for $t {
            fn put(&self, w: &mut W<'_>) {
                w.u8(*self as u8);
            }
            fn get(r: &mut R<'_>, field: &'static str) -> Result<Self, CodecError> {
                r.enum_u8(field, $of)
            }
        }
    )*};
}
wire_u8_enum!(Role => role, Purpose => purpose, RejectReason => reject, FailReason => fail, AbortReason => abort, FinishReason => finish);

/// A struct written field by field, in the order listed.
macro_rules! wire_struct {
    ($t:ident { $($f:ident),* $(,)? }) => {
        impl Wire for $t {
            fn put(&self, w: &mut W<'_>) {
                $(self.$f.put(w);)*
            }
            fn get(r: &mut R<'_>, _: &'static str) -> Result<Self, CodecError> {
                Ok($t { $($f: Wire::get(r, stringify!($f))?),* })
            }
        }
    };
}
wire_struct!(Hello { role, model_digest, page_size, kv_bytes_per_token, capacity_tokens, max_context, kv_addr, worker });

/// The message table (see above). `KvChunk` is written and read apart, straight between its
/// data and the frame (`FrameEncoder::encode_kv_chunk`, `decode_kv_chunk`), so it has only
/// its kind here.
macro_rules! messages {
    (
        newtype { $($nt:ident = $ntk:literal ($inner:ident)),* $(,)? }
        unit { $($u:ident = $uk:literal),* $(,)? }
        fields { $($s:ident = $sk:literal { $($f:ident),* $(,)? }),* $(,)? }
        apart { $($a:ident = $ak:literal),* $(,)? }
    ) => {
        /// Every message's kind byte on the wire.
        #[repr(u8)]
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        enum Kind {
            $($nt = $ntk,)* $($u = $uk,)* $($s = $sk,)* $($a = $ak,)*
        }

        impl Kind {
            fn of(k: u8) -> Option<Kind> {
                match k {
                    $($ntk => Some(Kind::$nt),)* $($uk => Some(Kind::$u),)* $($sk => Some(Kind::$s),)* $($ak => Some(Kind::$a),)*
                    _ => None,
                }
            }
        }

        impl Message {
            /// The message's name, for errors and logs that must not print its fields.
            pub fn kind_name(&self) -> &'static str {
                match self {
                    $(Message::$nt(..) => stringify!($nt),)*
                    $(Message::$u => stringify!($u),)*
                    $(Message::$s { .. } => stringify!($s),)*
                    $(Message::$a { .. } => stringify!($a),)*
                }
            }
        }

        /// Write `m`'s fields (not `KvChunk`'s); its kind.
        fn put_fields(m: &Message, w: &mut W<'_>) -> Kind {
            match m {
                $(Message::$nt(x) => { x.put(w); Kind::$nt })*
                $(Message::$u => Kind::$u,)*
                $(Message::$s { $($f),* } => { $($f.put(w);)* Kind::$s })*
                Message::KvChunk { req, header, data } => {
                    w.0.extend_from_slice(&kv_chunk_fields(*req, header, data.len()));
                    w.0.extend_from_slice(data);
                    Kind::KvChunk
                }
            }
        }

        /// Read the fields of a message of kind `kind` (not `KvChunk`).
        fn get_fields(kind: Kind, r: &mut R<'_>) -> Result<Message, CodecError> {
            Ok(match kind {
                $(Kind::$nt => Message::$nt(Wire::get(r, stringify!($nt))?),)*
                $(Kind::$u => Message::$u,)*
                $(Kind::$s => Message::$s { $($f: Wire::get(r, stringify!($f))?),* },)*
                // Read apart, by `decode_payload`, before it gets here.
                $(Kind::$a => return Err(CodecError::UnknownKind($ak)),)*
            })
        }
    };
}

messages! {
    newtype { Hello = 1 (Hello) }
    unit { KvKeepalive = 21, Room = 24 }
    fields {
        Welcome = 2 { gateway },
        Refuse = 3 { reason },
        KvHello = 4 { prefill },
        Reserve = 5 { req, prompt_tokens, max_tokens, prefill, sampling, stop, resume, prompt, trace, cache },
        Reserved = 6 { req, held, pages, local },
        Rejected = 7 { req, reason, detail },
        Prefill = 8 { req, tokens, decode, held, pages, sampling, skip_draws, trace, cache },
        Done = 10 { req, tokens, first_token, manifest, cached, first_logprobs },
        Fenced = 11 { req },
        Token = 12 { req, token, text, logprobs },
        Finished = 13 { req, finish, text, prompt_tokens, completion_tokens, cached_tokens },
        Failed = 14 { req, reason, detail },
        Abort = 15 { req, reason },
        DecodePeer = 16 { worker, addr },
        Cancel = 17 { req },
        Metrics = 18 { families },
        PrefillUnreachable = 19 { worker },
        KvLost = 20 { decode },
        Retracted = 22 { req, tokens },
        PeerLeft = 23 { worker },
        AuthHello = 25 { purpose, claim, nonce, encrypt },
        AuthChallenge = 26 { nonce, proof, encrypt },
        AuthProof = 27 { proof },
        AuthRefused = 28 { reason },
        CacheReport = 29 { stored, evicted },
        KvUcxAddress = 30 { address },
        KvUcxUse = 31 { address },
    }
    apart { KvChunk = 9 }
}

/// Append `m` as one frame to `out`.
pub fn encode(m: &Message, out: &mut Vec<u8>) {
    let start = out.len();
    out.extend_from_slice(&[MAGIC[0], MAGIC[1], VERSION, 0, 0, 0, 0, 0]);
    let kind = put_fields(m, &mut W(out));
    finish_header(out, start, kind as u8);
}

/// Fill in the kind and payload length of the frame that starts at `out[start]` and runs to
/// the end of `out`.
fn finish_header(out: &mut [u8], start: usize, kind: u8) {
    let len = (out.len() - start - HEADER) as u32;
    out[start + 3] = kind;
    out[start + 4..start + 8].copy_from_slice(&len.to_le_bytes());
}

/// A `KvChunk` payload's bytes before its data: request, chunk header, data length.
const KV_CHUNK_FIELDS: usize = 8 + ChunkHeader::LEN + 4;

fn kv_chunk_fields(req: RequestId, header: &ChunkHeader, data_len: usize) -> [u8; KV_CHUNK_FIELDS] {
    let mut f = [0u8; KV_CHUNK_FIELDS];
    f[..8].copy_from_slice(&req.0.to_le_bytes());
    f[8..8 + ChunkHeader::LEN].copy_from_slice(&header.bytes());
    f[8 + ChunkHeader::LEN..].copy_from_slice(&(data_len as u32).to_le_bytes());
    f
}

/// A `KvChunk` payload's request, chunk header and where in `b` its data lies.
fn decode_kv_chunk(b: &[u8]) -> Result<(RequestId, ChunkHeader, Range<usize>), CodecError> {
    let mut r = R { b, what: "message" };
    let req = r.req()?;
    let header = ChunkHeader {
        page: PageId(r.u32()?),
        generation: Generation(r.u64()?),
        slot_start: r.u32()?,
        slot_count: r.u32()?,
        checksum: r.u64()?,
    };
    let len = r.bytes()?.len();
    if !r.b.is_empty() {
        return Err(CodecError::Trailing(r.b.len()));
    }
    Ok((req, header, b.len() - len..b.len()))
}

fn decode_payload(kind: u8, b: &[u8], payloads: &Arc<PayloadPool>) -> Result<Message, CodecError> {
    let kind = Kind::of(kind).ok_or(CodecError::UnknownKind(kind))?;
    if kind == Kind::KvChunk {
        let (req, header, data) = decode_kv_chunk(b)?;
        return Ok(Message::KvChunk { req, header, data: payloads.copy_of(&b[data]) });
    }
    let mut r = R { b, what: "message" };
    let m = get_fields(kind, &mut r)?;
    if !r.b.is_empty() {
        return Err(CodecError::Trailing(r.b.len()));
    }
    Ok(m)
}

/// Encodes messages as frames, with a MAC after each once a handshake gave it a
/// [`Sealer`].
#[derive(Debug, Default)]
pub struct FrameEncoder {
    sealer: Option<Sealer>,
}

impl FrameEncoder {
    /// Frames without MACs (before a handshake, or in a cluster without a key).
    pub fn plain() -> Self {
        FrameEncoder { sealer: None }
    }

    /// Frames sealed by `sealer`.
    pub fn sealed(sealer: Sealer) -> Self {
        FrameEncoder { sealer: Some(sealer) }
    }

    /// Append `m` as one frame (and its MAC) to `out`.
    pub fn encode(&mut self, m: &Message, out: &mut Vec<u8>) {
        let start = out.len();
        encode(m, out);
        self.seal(out, start);
    }

    /// Append one `KvChunk` frame of `req` (and its MAC) to `out`, the same bytes as
    /// [`FrameEncoder::encode`] of the message, with the chunk's data appended to `out` by
    /// `fill`, which returns the chunk's header: the chunk is exported straight into its
    /// frame. Where `fill` has no chunk or fails, `out` is left as it was.
    pub fn encode_kv_chunk<E>(
        &mut self,
        req: RequestId,
        out: &mut Vec<u8>,
        fill: impl FnOnce(&mut Vec<u8>) -> Option<Result<ChunkHeader, E>>,
    ) -> Option<Result<(), E>> {
        let start = out.len();
        out.extend_from_slice(&[MAGIC[0], MAGIC[1], VERSION, 0, 0, 0, 0, 0]);
        out.resize(start + HEADER + KV_CHUNK_FIELDS, 0);
        let header = match fill(out) {
            Some(Ok(header)) => header,
            other => {
                out.truncate(start);
                return other.map(|r| r.map(|_| ()));
            }
        };
        let fields = start + HEADER;
        let data_len = out.len() - fields - KV_CHUNK_FIELDS;
        out[fields..fields + KV_CHUNK_FIELDS].copy_from_slice(&kv_chunk_fields(req, &header, data_len));
        finish_header(out, start, Kind::KvChunk as u8);
        self.seal(out, start);
        Some(Ok(()))
    }

    /// Seal the frame that starts at `out[start]`: append its MAC.
    fn seal(&mut self, out: &mut Vec<u8>, start: usize) {
        if let Some(s) = &mut self.sealer {
            let (header, payload) = out[start..].split_at_mut(HEADER);
            let tag = s.seal(header, payload);
            out.extend_from_slice(&tag);
        }
    }
}

/// Sans-IO frame decoder: push bytes as they arrive, take whole messages out. After a
/// handshake ([`crate::auth`]) it checks each frame's MAC before decoding it.
#[derive(Debug)]
pub struct FrameDecoder {
    /// Received bytes are `buf[taken..end]`; `buf` beyond `end` is room for the next read.
    buf: Vec<u8>,
    /// Bytes already decoded: moved out at the next push or read, so taking many frames out
    /// of one read moves the rest once, not once per frame.
    taken: usize,
    end: usize,
    max_frame: usize,
    opener: Option<Opener>,
    /// Where decoded KV chunks' buffers come from and go back to.
    payloads: Arc<PayloadPool>,
}

impl FrameDecoder {
    /// A decoder refusing payloads over `max_frame` bytes.
    pub fn new(max_frame: usize) -> Self {
        FrameDecoder { buf: Vec::new(), taken: 0, end: 0, max_frame, opener: None, payloads: Arc::default() }
    }

    /// From now on, refuse payloads over `max_frame` bytes (a port raises its limit once the
    /// peer has authenticated).
    pub fn set_max_frame(&mut self, max_frame: usize) {
        self.max_frame = max_frame;
    }

    /// From now on every frame must carry a MAC that `opener` accepts (bytes already
    /// buffered included: they came after the handshake's last frame).
    pub fn open_with(&mut self, opener: Opener) {
        self.opener = Some(opener);
    }

    /// Add received bytes.
    pub fn push(&mut self, bytes: &[u8]) {
        self.spare(bytes.len())[..bytes.len()].copy_from_slice(bytes);
        self.end += bytes.len();
    }

    /// Room for at least `n` more bytes, for a transport to read into directly (one copy
    /// less than [`FrameDecoder::push`]); then [`FrameDecoder::filled`] with the count.
    pub fn spare(&mut self, n: usize) -> &mut [u8] {
        if self.taken > 0 {
            self.buf.copy_within(self.taken..self.end, 0);
            self.end -= self.taken;
            self.taken = 0;
        }
        if self.buf.len() < self.end + n {
            self.buf.resize(self.end + n, 0);
        }
        &mut self.buf[self.end..]
    }

    /// Take `whole`, a buffer of whole received frames (one UCX message), as the bytes to
    /// decode: without a copy when nothing is buffered, else appended. Gives back a buffer
    /// to receive the next message into.
    pub fn feed_owned(&mut self, mut whole: Vec<u8>) -> Vec<u8> {
        if self.buffered() > 0 {
            self.push(&whole);
            return whole;
        }
        std::mem::swap(&mut self.buf, &mut whole);
        (self.taken, self.end) = (0, self.buf.len());
        whole
    }

    /// The most bytes one frame can take on the wire (header, largest payload, MAC).
    pub fn max_wire_frame(&self) -> usize {
        HEADER + self.max_frame + TAG_LEN
    }

    /// `n` bytes were written at the start of the last [`FrameDecoder::spare`].
    pub fn filled(&mut self, n: usize) {
        self.end = (self.end + n).min(self.buf.len());
    }

    /// The next whole message, `Ok(None)` if more bytes are needed. After an error the
    /// decoder is unusable: close the connection.
    pub fn next_message(&mut self) -> Result<Option<Message>, CodecError> {
        let buf = &mut self.buf[self.taken..self.end];
        if buf.len() < HEADER {
            // Refuse garbage as early as the magic is visible.
            if buf.len() >= 2 && buf[..2] != MAGIC {
                return Err(CodecError::BadMagic([buf[0], buf[1]]));
            }
            return Ok(None);
        }
        let h = &buf[..HEADER];
        if h[..2] != MAGIC {
            return Err(CodecError::BadMagic([h[0], h[1]]));
        }
        if h[2] != VERSION {
            return Err(CodecError::Version(h[2]));
        }
        let kind = h[3];
        let len = u32::from_le_bytes([h[4], h[5], h[6], h[7]]) as usize;
        if len > self.max_frame {
            return Err(CodecError::TooLarge { len, max: self.max_frame });
        }
        let tag = if self.opener.is_some() { TAG_LEN } else { 0 };
        if buf.len() < HEADER + len + tag {
            return Ok(None);
        }
        if let Some(o) = &mut self.opener {
            let (header, rest) = buf.split_at_mut(HEADER);
            let (payload, rest) = rest.split_at_mut(len);
            o.open(header, payload, &rest[..tag])?;
        }
        let frame = HEADER + len + tag;
        if kind == Kind::KvChunk as u8 && self.taken == 0 && self.end == frame && self.buf.len() == frame {
            // The buffer is this one frame (one UCX message): it becomes the chunk's payload
            // instead of being copied into one, and a pooled buffer takes its place.
            let (req, header, data) = decode_kv_chunk(&self.buf[HEADER..HEADER + len])?;
            let buf = std::mem::replace(&mut self.buf, self.payloads.spare());
            (self.taken, self.end) = (0, 0);
            return Ok(Some(Message::KvChunk { req, header, data: self.payloads.adopt(buf, HEADER + data.start..HEADER + data.end) }));
        }
        let at = self.taken + HEADER;
        let m = decode_payload(kind, &self.buf[at..at + len], &self.payloads);
        self.taken += frame;
        m.map(Some)
    }

    /// Bytes received but not yet decoded.
    pub fn buffered(&self) -> usize {
        self.end - self.taken
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn samples() -> Vec<Message> {
        let s = Sampling {
            temperature: 0.7,
            top_k: 40,
            top_p: 0.9,
            seed: Some(7),
            ignore_eos: true,
            skip_special_tokens: false,
            ..Sampling::default()
        };
        let constrained = Sampling {
            min_p: 0.05,
            presence_penalty: 0.5,
            frequency_penalty: -0.25,
            repetition_penalty: 1.1,
            logit_bias: vec![(3, -100.0), (9, 2.5)],
            min_tokens: 4,
            stop_token_ids: vec![7, 8],
            logprobs: Some(5),
            grammar: Some(GrammarSpec::JsonSchema("{\"type\":\"object\"}".into())),
            ..s.clone()
        };
        let grammars = [
            GrammarSpec::JsonObject,
            GrammarSpec::Regex("[0-9]+".into()),
            GrammarSpec::Choice(vec!["yes".into(), "no".into()]),
            GrammarSpec::Lark("start: \"a\"".into()),
        ];
        let pages = vec![PageRef { page: PageId(3), generation: Generation(9) }];
        let trace = TraceContext { trace_id: *b"0123456789abcdef", request_id: "req-1".into(), tenant: "acme".into() };
        let mut all = vec![
            Message::Hello(Hello {
                role: Role::Decode,
                model_digest: 42,
                page_size: 16,
                kv_bytes_per_token: 23040,
                capacity_tokens: 1 << 20,
                max_context: 8192,
                kv_addr: "127.0.0.1:9".into(),
                worker: WorkerId(0x8000_0003),
            }),
            Message::Welcome { gateway: GatewayId(2) },
            Message::Refuse { reason: "model differs".into() },
            Message::KvHello { prefill: WorkerId(1) },
            Message::PrefillUnreachable { worker: WorkerId(4) },
            Message::KvLost { decode: WorkerId(5) },
            Message::KvKeepalive,
            Message::Reserve {
                req: RequestId(5),
                prompt_tokens: 9,
                max_tokens: 3,
                prefill: WorkerId(1),
                sampling: s.clone(),
                stop: vec!["x".into(), "".into()],
                resume: vec![8, 9],
                prompt: vec![1, 2, 3],
                trace: trace.clone(),
                cache: Some(CacheScope([9; 32])),
            },
            Message::Reserved { req: RequestId(5), held: 32, pages: pages.clone(), local: false },
            Message::Reserved { req: RequestId(5), held: 32, pages: Vec::new(), local: true },
            Message::Rejected { req: RequestId(5), reason: RejectReason::ContextLength, detail: "too long".into() },
            Message::Prefill {
                req: RequestId(5),
                tokens: vec![1, 2, 3],
                decode: WorkerId(2),
                held: 16,
                pages: pages.clone(),
                sampling: s.clone(),
                skip_draws: 2,
                trace: trace.clone(),
                cache: None,
            },
            Message::Prefill {
                req: RequestId(6),
                tokens: vec![1],
                decode: WorkerId(2),
                held: 0,
                pages,
                sampling: s,
                skip_draws: 0,
                trace,
                cache: Some(CacheScope([3; 32])),
            },
            Message::CacheReport { stored: vec![PageKey([1; 16]), PageKey([2; 16])], evicted: vec![] },
            Message::Retracted { req: RequestId(5), tokens: vec![4, 5] },
            Message::PeerLeft { worker: WorkerId(2) },
            Message::Room,
            Message::AuthHello { purpose: Purpose::Kv, claim: 3, nonce: [7; 32], encrypt: true },
            Message::AuthChallenge { nonce: [8; 32], proof: [9; 32], encrypt: false },
            Message::AuthProof { proof: [10; 32] },
            Message::AuthRefused { reason: "no key".into() },
            Message::KvUcxAddress { address: vec![1, 2, 3] },
            Message::KvUcxAddress { address: Vec::new() },
            Message::KvUcxUse { address: vec![4, 5] },
            Message::KvChunk {
                req: RequestId(5),
                header: ChunkHeader { page: PageId(3), generation: Generation(9), slot_start: 0, slot_count: 2, checksum: 77 },
                data: vec![1, 2, 3, 4].into(),
            },
            Message::Done { req: RequestId(5), tokens: 3, first_token: 11, manifest: 99, cached: 2, first_logprobs: None },
            Message::Done {
                req: RequestId(5),
                tokens: 3,
                first_token: 11,
                manifest: 99,
                cached: 2,
                first_logprobs: Some(TokenLogprobs { logprob: -0.5, top: vec![(11, -0.5), (3, -1.5)] }),
            },
            Message::Fenced { req: RequestId(5) },
            Message::Token { req: RequestId(5), token: 4, text: "héllo".into(), logprobs: None },
            Message::Token {
                req: RequestId(5),
                token: 4,
                text: String::new(),
                logprobs: Some(TokenLogprobs { logprob: -2.0, top: vec![] }),
            },
            Message::Finished {
                req: RequestId(5),
                finish: FinishReason::Length,
                text: String::new(),
                prompt_tokens: 3,
                completion_tokens: 1,
                cached_tokens: 2,
            },
            Message::Failed { req: RequestId(5), reason: FailReason::TransferRefused, detail: "checksum".into() },
            Message::Abort { req: RequestId(5), reason: AbortReason::ClientGone },
            Message::DecodePeer { worker: WorkerId(2), addr: "127.0.0.1:7".into() },
            Message::Cancel { req: RequestId(5) },
            Message::Metrics { families: vec![] },
            Message::Metrics {
                families: vec![
                    MetricFamily {
                        name: "bulkhead:kv_cache_usage_perc".into(),
                        help: "KV pages in use".into(),
                        kind: MetricKind::Gauge,
                        samples: vec![MetricSample { name: "bulkhead:kv_cache_usage_perc".into(), labels: vec![], value: 0.25 }],
                    },
                    MetricFamily {
                        name: "x".into(),
                        help: String::new(),
                        kind: MetricKind::Histogram,
                        samples: vec![
                            MetricSample {
                                name: "x_bucket".into(),
                                labels: vec![("le".into(), "+Inf".into()), ("k".into(), "v\"".into())],
                                value: 3.0,
                            },
                            MetricSample { name: "x_sum".into(), labels: vec![], value: f64::MAX },
                        ],
                    },
                ],
            },
        ];
        let prefill = |req: u64, sampling: Sampling| Message::Prefill {
            req: RequestId(req),
            tokens: vec![1],
            decode: WorkerId(2),
            held: 0,
            pages: vec![],
            sampling,
            skip_draws: 0,
            trace: TraceContext::default(),
            cache: None,
        };
        all.push(prefill(7, constrained.clone()));
        all.extend(
            grammars.into_iter().enumerate().map(|(i, g)| prefill(8 + i as u64, Sampling { grammar: Some(g), ..constrained.clone() })),
        );
        all
    }

    #[test]
    fn every_message_round_trips_through_a_byte_stream_split_anywhere() {
        let mut bytes = Vec::new();
        let msgs = samples();
        msgs.iter().for_each(|m| encode(m, &mut bytes));
        for step in [1, 3, 7, 64, bytes.len()] {
            let mut d = FrameDecoder::new(DEFAULT_MAX_FRAME);
            let mut got = Vec::new();
            for c in bytes.chunks(step) {
                d.push(c);
                while let Some(m) = d.next_message().unwrap() {
                    got.push(m);
                }
            }
            assert_eq!(got, msgs);
            assert_eq!(d.buffered(), 0);
        }
    }

    /// One frame per owned buffer (as UCX delivers them), with a part-frame left over in
    /// between: the same messages as from a byte stream, through the same opener.
    #[test]
    fn owned_buffers_decode_like_a_stream() {
        let (mut enc, mut d) = sealed_pair(true);
        let msgs = samples();
        let mut frame = Vec::new();
        let mut got = Vec::new();
        for (i, m) in msgs.iter().enumerate() {
            frame.clear();
            enc.encode(m, &mut frame);
            if i == 3 {
                // Half a frame through the stream path, the rest as an owned buffer.
                d.push(&frame[..5]);
                frame.drain(..5);
            }
            // The decoder's old buffer comes back, to receive the next frame into.
            frame = d.feed_owned(frame);
            while let Some(m) = d.next_message().unwrap() {
                got.push(m);
            }
        }
        assert_eq!(got, msgs);
        assert_eq!(d.buffered(), 0);
    }

    /// Sealer and opener of one direction of a fresh session.
    fn sealed_pair(encrypt: bool) -> (FrameEncoder, FrameDecoder) {
        use crate::auth::{Client, ClusterKey, Server};
        let key = ClusterKey::from_bytes([1; 32]);
        let (client, hello) = Client::start(&key, Purpose::Control, 0, encrypt, [2; 32]);
        let (server, challenge) = Server::start(&key, Purpose::Control, hello, false, [3; 32]).unwrap();
        let (proof, c) = client.finish(challenge).unwrap();
        let s = server.finish(proof).unwrap();
        let mut d = FrameDecoder::new(DEFAULT_MAX_FRAME);
        d.open_with(s.recv);
        (FrameEncoder::sealed(c.send), d)
    }

    #[test]
    fn a_chunk_that_is_a_whole_received_buffer_becomes_its_payload_and_buffers_rotate() {
        let header = ChunkHeader { page: PageId(1), generation: Generation(2), slot_start: 0, slot_count: 1, checksum: 3 };
        let m = Message::KvChunk { req: RequestId(8), header, data: vec![5u8; 4096].into() };
        let mut frame = Vec::new();
        encode(&m, &mut frame);
        let mut d = FrameDecoder::new(DEFAULT_MAX_FRAME);
        let (mut spare, mut seen) = (Vec::new(), Vec::new());
        for round in 0..6 {
            // As a UCX receive into the spare buffer does.
            let mut buf = std::mem::take(&mut spare);
            buf.clear();
            buf.extend_from_slice(&frame);
            let at = buf.as_ptr() as usize;
            spare = d.feed_owned(buf);
            let got = d.next_message().unwrap().unwrap();
            let Message::KvChunk { data, .. } = &got else { panic!("{got:?}") };
            assert_eq!(data.as_ptr() as usize, at + frame.len() - 4096, "round {round}: the payload is the received buffer, not a copy");
            assert_eq!(got, m);
            assert_eq!(d.next_message().unwrap(), None);
            seen.push(at);
        }
        assert!(seen[3..].iter().all(|p| seen[..3].contains(p)), "three buffers take turns, none is allocated after them: {seen:x?}");
    }

    #[test]
    fn a_chunk_exported_into_its_frame_is_the_frame_of_its_message() {
        let (req, header) =
            (RequestId(5), ChunkHeader { page: PageId(4), generation: Generation(7), slot_start: 2, slot_count: 3, checksum: 99 });
        let data: Vec<u8> = (0..=255).collect();
        let m = Message::KvChunk { req, header, data: data.clone().into() };
        for sealed in [false, true] {
            let pair = || if sealed { sealed_pair(true) } else { (FrameEncoder::plain(), FrameDecoder::new(DEFAULT_MAX_FRAME)) };
            let ((mut by_message, _), (mut in_place, mut d)) = (pair(), pair());
            let mut want = vec![9];
            by_message.encode(&m, &mut want);
            let mut got = vec![9];
            let filled = in_place.encode_kv_chunk(req, &mut got, |out| {
                out.extend_from_slice(&data);
                Some(Ok::<_, &str>(header))
            });
            assert_eq!((filled, &got), (Some(Ok(())), &want), "sealed: {sealed}");
            // No chunk, or a failed export, writes nothing and seals nothing: the next frame
            // still opens.
            assert_eq!(in_place.encode_kv_chunk::<&str>(req, &mut got, |_| None), None);
            let failed = in_place.encode_kv_chunk(req, &mut got, |out| {
                out.push(1);
                Some(Err("export"))
            });
            assert_eq!((failed, &got), (Some(Err("export")), &want));
            in_place.encode(&Message::KvKeepalive, &mut got);
            d.push(&got[1..]);
            assert_eq!(d.next_message().unwrap(), Some(m.clone()));
            assert_eq!(d.next_message().unwrap(), Some(Message::KvKeepalive));
        }
    }

    #[test]
    fn sealed_frames_round_trip_and_any_flipped_byte_stops_the_stream_before_a_wrong_message() {
        for encrypt in [false, true] {
            sealed_stream(encrypt);
        }
    }

    fn sealed_stream(encrypt: bool) {
        let msgs = samples();
        let (mut enc, mut d) = sealed_pair(encrypt);
        let mut bytes = Vec::new();
        msgs.iter().for_each(|m| enc.encode(m, &mut bytes));
        let mut plain = Vec::new();
        msgs.iter().for_each(|m| encode(m, &mut plain));
        // Encrypted: no message's payload survives in the clear (a "Refuse" reason is a
        // readable string in a MAC-only stream).
        assert_eq!(bytes.windows(13).any(|w| w == b"model differs"), !encrypt);
        d.push(&bytes);
        let mut got = Vec::new();
        while let Some(m) = d.next_message().unwrap() {
            got.push(m);
        }
        assert_eq!(got, msgs);
        for i in 0..bytes.len() {
            let mut bad = bytes.clone();
            bad[i] ^= 0x01;
            let (_, mut d) = sealed_pair(encrypt);
            d.push(&bad);
            let mut got = Vec::new();
            let end = loop {
                match d.next_message() {
                    Ok(Some(m)) => got.push(m),
                    other => break other,
                }
            };
            assert!(end.is_err() || matches!(end, Ok(None)), "byte {i}: {end:?}");
            assert!(got.len() < msgs.len() && got[..] == msgs[..got.len()], "byte {i}: a changed message got through");
        }
        // A sealed stream read without the key's opener, and a plain one read with it.
        plain.clear();
        encode(&msgs[0], &mut plain);
        let (_, mut d) = sealed_pair(encrypt);
        d.push(&plain);
        d.push(&[0; TAG_LEN]);
        assert!(matches!(d.next_message(), Err(CodecError::Auth(AuthError::BadTag))));
    }

    #[test]
    fn garbage_oversize_unknown_and_truncated_frames_are_errors() {
        let mut d = FrameDecoder::new(DEFAULT_MAX_FRAME);
        d.push(b"GET / HTTP/1.1\r\n");
        assert!(matches!(d.next_message(), Err(CodecError::BadMagic(_))));
        let mut d = FrameDecoder::new(100);
        d.push(&[b'B', b'H', VERSION, 9, 0xff, 0xff, 0, 0]);
        assert!(matches!(d.next_message(), Err(CodecError::TooLarge { .. })));
        let mut d = FrameDecoder::new(100);
        d.push(&[b'B', b'H', VERSION + 1, 9, 0, 0, 0, 0]);
        assert!(matches!(d.next_message(), Err(CodecError::Version(_))));
        let mut d = FrameDecoder::new(100);
        d.push(&[b'B', b'H', VERSION, 200, 0, 0, 0, 0]);
        assert!(matches!(d.next_message(), Err(CodecError::UnknownKind(200))));
        // A Fenced frame whose payload is one byte short, and one with a byte too many.
        let mut d = FrameDecoder::new(100);
        d.push(&[b'B', b'H', VERSION, 11, 7, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7]);
        assert!(matches!(d.next_message(), Err(CodecError::Truncated(_))));
        let mut d = FrameDecoder::new(100);
        d.push(&[b'B', b'H', VERSION, 11, 9, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9]);
        assert!(matches!(d.next_message(), Err(CodecError::Trailing(1))));
        // A list count far beyond the payload.
        let mut d = FrameDecoder::new(100);
        d.push(&[b'B', b'H', VERSION, 6, 12, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 0xff, 0x7f]);
        assert!(matches!(d.next_message(), Err(CodecError::Truncated(_))));
    }

    #[test]
    fn metrics_frames_with_a_bad_kind_or_counts_beyond_the_payload_are_errors() {
        let m = Message::Metrics {
            families: vec![MetricFamily {
                name: "a".into(),
                help: "h".into(),
                kind: MetricKind::Counter,
                samples: vec![MetricSample { name: "a".into(), labels: vec![], value: 1.0 }],
            }],
        };
        let mut good = Vec::new();
        encode(&m, &mut good);
        // Payload: family count (4), name (4 + 1), help (4 + 1), kind (1), sample count (4), ...
        let kind_at = HEADER + 4 + 5 + 5;
        let mut bad_kind = good.clone();
        bad_kind[kind_at] = 3;
        let mut many_samples = good.clone();
        many_samples[kind_at + 1..kind_at + 5].copy_from_slice(&1000u32.to_le_bytes());
        for (bytes, want) in
            [(bad_kind, CodecError::Invalid { field: "metric kind", value: 3 }), (many_samples, CodecError::Truncated("message"))]
        {
            let mut d = FrameDecoder::new(DEFAULT_MAX_FRAME);
            d.push(&bytes);
            assert_eq!(d.next_message(), Err(want));
        }
        let mut d = FrameDecoder::new(DEFAULT_MAX_FRAME);
        d.push(&good);
        assert_eq!(d.next_message(), Ok(Some(m)));
    }

    #[test]
    fn every_prefix_and_every_byte_flip_of_valid_frames_is_handled_without_panic() {
        let mut bytes = Vec::new();
        samples().iter().for_each(|m| encode(m, &mut bytes));
        for i in 0..bytes.len() {
            for flip in [0x01u8, 0x80, 0xff] {
                let mut b = bytes.clone();
                b[i] ^= flip;
                let mut d = FrameDecoder::new(1 << 16);
                d.push(&b);
                while let Ok(Some(_)) = d.next_message() {}
            }
        }
    }
}
