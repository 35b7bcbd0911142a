//! Two workers in two threads of one process, as the decode and prefill sides use them.
//! Without a loadable UCX these tests say so and pass without running (`scripts/test.sh`
//! installs it where it can, so CI runs them).

use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::mpsc;
use std::time::Duration;

use bulkhead_ucx::{Peer, Received, Receiver, Sender, Transports, UcxError};

const T: Duration = Duration::from_secs(20);

fn ucx_here() -> bool {
    match bulkhead_ucx::version() {
        Ok(_) => true,
        Err(e) => {
            eprintln!("skipped: UCX is not usable here ({e})");
            false
        }
    }
}

fn message(i: usize) -> Vec<u8> {
    // Sizes from one byte past the eager/rendezvous switch to several MiB.
    let len = [1, 100, 8_000, 9_000, 300_000, 4 << 20][i % 6] + i;
    (0..len).map(|k| (k * 31 + i) as u8).collect()
}

/// A receiver thread that takes `n` messages (or stops at the first other outcome) and
/// returns what it got; the control "connection" is a socket pair. With `back`, it first
/// opens the endpoint back to the sender whose address arrives there, as the decode worker
/// does.
fn receive(
    n: usize,
    watch: UnixStream,
    addr_tx: mpsc::Sender<Vec<u8>>,
    limit: usize,
    back: Option<mpsc::Receiver<Vec<u8>>>,
    peer: Peer,
) -> Got {
    std::thread::spawn(move || {
        let mut r = Receiver::new(Transports::Fast, peer).map_err(|e| e.to_string())?;
        addr_tx.send(r.address().to_vec()).map_err(|e| e.to_string())?;
        if let Some(back) = back {
            r.connect_back(&back.recv().map_err(|e| e.to_string())?).map_err(|e| e.to_string())?;
        }
        let mut got = Vec::new();
        while got.len() < n {
            match r.recv(watch.as_raw_fd(), limit, T, Vec::new()) {
                Ok(Received::Message(m)) => got.push(m),
                Ok(Received::Watch) => return Err(format!("watch fired after {} messages", got.len())),
                Err(e) => return Err(e.to_string()),
            }
        }
        Ok(got)
    })
}

/// Result of a [`receive`] thread.
type Got = std::thread::JoinHandle<Result<Vec<Vec<u8>>, String>>;

/// A started [`receive`] thread for `n` messages under `limit` from a `peer`, its address,
/// and the sender's end of the control socket.
fn started(n: usize, limit: usize, back: Option<mpsc::Receiver<Vec<u8>>>, peer: Peer) -> (Got, Vec<u8>, UnixStream) {
    let (a, b) = UnixStream::pair().unwrap();
    let (tx, rx) = mpsc::channel();
    let receiver = receive(n, a, tx, limit, back, peer);
    (receiver, rx.recv().unwrap(), b)
}

/// Both ways large messages move: eager through shared memory, and rendezvous.
const PEERS: [Peer; 2] = [Peer::SameHost, Peer::OtherHost];

#[test]
fn messages_arrive_whole_and_in_order() {
    if !ucx_here() {
        return;
    }
    for peer in PEERS {
        let (back_tx, back_rx) = mpsc::channel();
        let n = 60;
        let (receiver, address, b) = started(n, 16 << 20, Some(back_rx), peer);
        let sender = std::thread::spawn(move || -> Result<(Sender, UnixStream), UcxError> {
            let mut s = Sender::connect(&address, Transports::Fast, peer)?;
            back_tx.send(s.address().to_vec()).unwrap();
            for i in 0..n {
                s.send(message(i), b.as_raw_fd(), T)?;
            }
            // Kept open until the receiver has everything (see `a_message_over_the_limit_is_refused`).
            Ok((s, b))
        });
        let got = receiver.join().unwrap().unwrap();
        let (s, _b) = sender.join().unwrap().unwrap();
        let transports = s.transports();
        eprintln!("{peer:?} transports: {transports}");
        assert!(!transports.contains("tcp"), "the fast set excludes UCX's TCP: {transports}");
        for (i, m) in got.iter().enumerate() {
            assert!(*m == message(i), "{peer:?}: message {i} differs");
        }
    }
}

#[test]
fn a_message_over_the_limit_is_refused() {
    if !ucx_here() {
        return;
    }
    for peer in PEERS {
        let (receiver, address, b) = started(1, 1000, None, peer);
        let sender = std::thread::spawn(move || {
            let mut s = Sender::connect(&address, Transports::Fast, peer).unwrap();
            // The receiver drops the connection: the send ends (error or not), it does not hang.
            let _ = s.send(message(4), b.as_raw_fd(), Duration::from_secs(2));
            // Both ends stay open until the receiver has answered: an eager send completes
            // before the bytes are delivered, and closing the control connection (or the
            // sender) right after it could end the receive before the message is seen.
            (s, b)
        });
        let err = receiver.join().unwrap().unwrap_err();
        assert!(err.contains("over the limit"), "{peer:?}: {err}");
        drop(sender.join().unwrap());
    }
}

#[test]
fn the_control_connection_ending_wakes_the_receiver() {
    if !ucx_here() {
        return;
    }
    let (receiver, _address, b) = started(1, 1000, None, Peer::SameHost);
    drop(b);
    let err = receiver.join().unwrap().unwrap_err();
    assert!(err.contains("watch fired after 0"), "{err}");
}

#[test]
fn a_send_to_a_receiver_that_went_away_ends() {
    if !ucx_here() {
        return;
    }
    let (tx, rx) = mpsc::channel();
    // The receiver gives its address and is gone before anything is sent.
    std::thread::spawn(move || {
        let r = Receiver::new(Transports::Fast, Peer::SameHost).unwrap();
        tx.send(r.address().to_vec()).unwrap();
    })
    .join()
    .unwrap();
    let address = rx.recv().unwrap();
    let (_a, b) = UnixStream::pair().unwrap();
    let t = std::time::Instant::now();
    let r = Sender::connect(&address, Transports::Fast, Peer::SameHost)
        .and_then(|mut s| s.send(message(5), b.as_raw_fd(), Duration::from_secs(3)).map(drop));
    assert!(r.is_err(), "a send to nobody cannot succeed");
    assert!(t.elapsed() < Duration::from_secs(15), "it ends within its timeout: {:?}", t.elapsed());
}

#[test]
fn garbage_addresses_are_refused_before_ucx_sees_them() {
    assert!(matches!(Sender::connect(&[], Transports::Fast, Peer::SameHost), Err(UcxError::BadAddress(0))));
    assert!(matches!(
        Sender::connect(&vec![0; bulkhead_ucx::MAX_ADDRESS + 1], Transports::Fast, Peer::SameHost),
        Err(UcxError::BadAddress(_))
    ));
}
