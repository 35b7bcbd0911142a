//! Cluster trust at the process edge (issue 18): where the cluster key comes from, and
//! which listeners may run without one. The handshake and the frame MACs themselves are
//! sans-IO, in [`bulkhead_protocol::auth`]; [`crate::wire`] runs them over sockets.

use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::sync::Arc;

use bulkhead_protocol::auth::{ClusterKey, KEY_LEN};

/// How this process's internal connections are secured.
#[derive(Clone, Debug, Default)]
pub struct Trust {
    /// The cluster key; `None`: no handshake, no MACs.
    pub key: Option<Arc<ClusterKey>>,
    /// `--insecure-cluster`: internal listeners may face the network without a key.
    pub insecure: bool,
    /// `--cluster-encryption`: when this side asks for encrypted frames.
    pub encryption: Encryption,
}

/// When a process asks for its internal frames to be encrypted (AES-256-GCM under the
/// session key) as well as authenticated. A session is encrypted if either side asks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Encryption {
    /// Between hosts: on; with a loopback peer: off (the bytes never leave the machine).
    #[default]
    Auto,
    /// Always, loopback included.
    On,
    /// Never asked for by this side (the peer may still ask).
    Off,
}

/// Why the cluster's trust settings refuse to start.
#[derive(Debug, thiserror::Error)]
pub enum TrustError {
    // The I/O error is shown in the message, not chained as a `source` too (an error
    // printed with its causes would name it twice).
    #[error("cannot read the cluster key file {path}: {error}")]
    Read { path: String, error: std::io::Error },
    #[error(
        "the cluster key file {path} already exists; `bulkhead keygen` never overwrites a key. To replace it, \
         remove the file first, then give the new one to every process of the cluster"
    )]
    Exists { path: String },
    #[error("cannot write the cluster key file {path}: {error}")]
    Write { path: String, error: std::io::Error },
    #[error("the cluster key file {path} is readable or writable by others (mode {mode:o}); run `chmod 600 {path}`")]
    Permissions { path: String, mode: u32 },
    #[error("the cluster key file {path} does not hold a key: {error}")]
    Format { path: String, error: bulkhead_protocol::auth::AuthError },
    #[error(
        "the {what} listens on {addr}, which is not a loopback address, and this cluster has no key: \
         anyone who reaches it could join the cluster. Pass --cluster-key-file FILE (make one with \
         `bulkhead keygen FILE`) on every process of the cluster, or --insecure-cluster to accept the risk"
    )]
    OpenListener { what: &'static str, addr: SocketAddr },
    #[error("cannot make a random key: {0}")]
    Random(String),
    #[error("--cluster-encryption on needs a cluster key (--cluster-key-file FILE): the frames are encrypted under a key derived from it")]
    EncryptionWithoutKey,
}

impl Trust {
    /// A cluster with `key`, encrypting between hosts.
    pub fn with_key(key: ClusterKey) -> Self {
        Trust { key: Some(Arc::new(key)), insecure: false, encryption: Encryption::Auto }
    }

    /// Settings as given; refused when they cannot hold (encryption without a key).
    pub fn new(key: Option<ClusterKey>, insecure: bool, encryption: Encryption) -> Result<Self, TrustError> {
        if key.is_none() && encryption == Encryption::On {
            return Err(TrustError::EncryptionWithoutKey);
        }
        Ok(Trust { key: key.map(Arc::new), insecure, encryption })
    }

    /// Whether this side asks for encryption on a connection with `peer` (unknown: as if
    /// it were another host).
    pub fn wants_encryption(&self, peer: Option<IpAddr>) -> bool {
        match self.encryption {
            Encryption::On => true,
            Encryption::Off => false,
            Encryption::Auto => !peer.is_some_and(|ip| ip.is_loopback()),
        }
    }

    /// Fail closed: an internal listener on a non-loopback address needs a key, unless
    /// `--insecure-cluster` says otherwise (logged loudly).
    pub fn check_listener(&self, what: &'static str, addr: SocketAddr) -> Result<(), TrustError> {
        if self.key.is_some() || addr.ip().is_loopback() {
            return Ok(());
        }
        if self.insecure {
            tracing::error!(%addr, what, "INSECURE CLUSTER: this internal listener faces the network without a cluster key; any process that reaches it can join the cluster and write KV (--insecure-cluster)");
            return Ok(());
        }
        Err(TrustError::OpenListener { what, addr })
    }

    /// What the start-up log line says about internal connections.
    pub fn describe(&self) -> &'static str {
        match (&self.key, self.insecure, self.encryption) {
            (Some(_), _, Encryption::Auto) => {
                "cluster key: mutual authentication and a tag on every internal frame; frames between hosts are encrypted (AES-256-GCM), frames over loopback are not (each connection's log line says which)"
            }
            (Some(_), _, Encryption::On) => {
                "cluster key: mutual authentication; every internal frame is encrypted and authenticated (AES-256-GCM)"
            }
            (Some(_), _, Encryption::Off) => {
                "cluster key: mutual authentication and a MAC on every internal frame; this side does not ask for encryption (--cluster-encryption off), so frames travel in the clear unless the peer asks"
            }
            (None, true, _) => "NO cluster key (--insecure-cluster): internal connections are neither authenticated nor encrypted",
            (None, false, _) => "no cluster key: internal connections are neither authenticated nor encrypted (loopback only)",
        }
    }
}

/// Read a key file: 64 hexadecimal digits, and not readable by group or others.
pub fn load_key_file(path: &Path) -> Result<ClusterKey, TrustError> {
    let shown = path.display().to_string();
    let meta = std::fs::metadata(path).map_err(|error| TrustError::Read { path: shown.clone(), error })?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = meta.permissions().mode() & 0o777;
        if mode & 0o077 != 0 {
            return Err(TrustError::Permissions { path: shown, mode });
        }
    }
    #[cfg(not(unix))]
    let _ = meta;
    let text = std::fs::read_to_string(path).map_err(|error| TrustError::Read { path: shown.clone(), error })?;
    ClusterKey::from_hex(&text).map_err(|error| TrustError::Format { path: shown, error })
}

/// A new random key.
pub fn generate_key() -> Result<ClusterKey, TrustError> {
    Ok(ClusterKey::from_bytes(random()?))
}

/// Write a new random key to `path`, readable by its owner only; refuses to overwrite.
pub fn write_key_file(path: &Path) -> Result<(), TrustError> {
    use std::io::Write;
    let key = generate_key()?;
    let shown = path.display().to_string();
    let mut opts = std::fs::OpenOptions::new();
    opts.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        opts.mode(0o600);
    }
    let mut f = opts.open(path).map_err(|error| match error.kind() {
        std::io::ErrorKind::AlreadyExists => TrustError::Exists { path: shown.clone() },
        _ => TrustError::Write { path: shown.clone(), error },
    })?;
    writeln!(f, "{}", key.to_hex()).map_err(|error| TrustError::Write { path: shown, error })
}

/// 32 random bytes from the operating system: keys and handshake nonces.
pub fn random() -> Result<[u8; KEY_LEN], TrustError> {
    let mut b = [0u8; KEY_LEN];
    getrandom::fill(&mut b).map_err(|e| TrustError::Random(e.to_string()))?;
    Ok(b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_open_listener_needs_a_key_or_the_insecure_flag() {
        let open: SocketAddr = "0.0.0.0:9000".parse().unwrap();
        let local: SocketAddr = "127.0.0.1:9000".parse().unwrap();
        let none = Trust::default();
        assert!(none.check_listener("KV port", local).is_ok());
        let err = none.check_listener("KV port", open).unwrap_err().to_string();
        assert!(err.contains("--cluster-key-file") && err.contains("0.0.0.0:9000"), "{err}");
        assert!(Trust { insecure: true, ..Trust::default() }.check_listener("KV port", open).is_ok());
        assert!(Trust::with_key(ClusterKey::from_bytes([1; 32])).check_listener("KV port", open).is_ok());
    }

    #[test]
    fn encryption_is_asked_for_between_hosts_by_default_and_needs_a_key_when_forced() {
        let key = || Some(ClusterKey::from_bytes([1; 32]));
        let (there, here) = (Some("10.0.0.2".parse().unwrap()), Some("127.0.0.1".parse().unwrap()));
        let auto = Trust::new(key(), false, Encryption::Auto).unwrap();
        assert!(auto.wants_encryption(there) && auto.wants_encryption(None) && !auto.wants_encryption(here));
        let on = Trust::new(key(), false, Encryption::On).unwrap();
        assert!(on.wants_encryption(here));
        let off = Trust::new(key(), false, Encryption::Off).unwrap();
        assert!(!off.wants_encryption(there));
        assert!(matches!(Trust::new(None, false, Encryption::On), Err(TrustError::EncryptionWithoutKey)));
    }

    #[cfg(unix)]
    #[test]
    fn a_key_file_is_made_private_read_back_and_refused_when_others_can_read_it() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("bulkhead-key-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("cluster.key");
        let _ = std::fs::remove_file(&path);
        write_key_file(&path).unwrap();
        assert!(matches!(write_key_file(&path), Err(TrustError::Exists { .. })), "never overwrites a key");
        assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o600);
        load_key_file(&path).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let err = load_key_file(&path).unwrap_err().to_string();
        assert!(err.contains("chmod 600"), "{err}");
        std::fs::write(&path, "not a key").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert!(matches!(load_key_file(&path), Err(TrustError::Format { .. })));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
