//! `Store`: c10d's TCPStore, the key-value rendezvous every rank meets at.
//!
//! Every operation is bounded: c10d's client waits without end for a server that accepted the
//! connection and never answers (its handshake and the replies to `add`, `check` and a cancelled
//! wait read with no timeout), so each call runs on a thread of its own while the caller waits
//! for it at most the store's timeout (plus a grace for c10d's own timeout to fire first), and
//! no longer than a stop signal allows ([`crate::signals::interruption`]). A call given up on
//! keeps the store alive until it returns; the process then ends with the error.
use std::ffi::CString;
use std::net::TcpListener;
use std::os::fd::IntoRawFd;
use std::ptr::NonNull;
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use super::error::{Error, Result};
use super::{check, ffi};

/// How much longer than the store's timeout a call may take before it is given up on: c10d's
/// own timeouts fire first, with their message, whenever they fire at all.
const GRACE: Duration = Duration::from_secs(1);
/// How often a waiting caller looks at the signals.
const TICK: Duration = Duration::from_millis(20);

/// The c10d store itself, shared with the threads that run its calls.
struct Handle(NonNull<ffi::RnStore>);

// SAFETY: c10d::TCPStore serialises its client socket behind a mutex; it may be used from any thread.
unsafe impl Send for Handle {}
// SAFETY: as above, every method takes the store's own lock.
unsafe impl Sync for Handle {}

impl Drop for Handle {
    fn drop(&mut self) {
        // SAFETY: the handle is live and dropped exactly once (the last Arc holding it).
        unsafe { ffi::rn_store_free(self.0.as_ptr()) }
    }
}

/// A TCPStore server or client. Every operation is bounded by the store's timeout.
pub struct Store {
    handle: Arc<Handle>,
    timeout: Duration,
}

fn ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

fn key_c(key: &str, op: &str) -> Result<CString> {
    CString::new(key).map_err(|_| Error::new(op, format!("key {key:?} contains a NUL byte")))
}

/// Runs `call` on a thread of its own and waits for it: at most `timeout` + [`GRACE`], and only
/// until a stop signal arrives.
pub(super) fn bounded<T: Send + 'static>(
    op: &str,
    timeout: Duration,
    call: impl FnOnce() -> Result<T> + Send + 'static,
) -> Result<T> {
    let (tx, rx) = mpsc::channel();
    std::thread::Builder::new()
        .name("store".into())
        .spawn(move || {
            let _ = tx.send(call());
        })
        .map_err(|e| Error::new(op, format!("cannot start a thread: {e}")))?;
    let deadline = Instant::now() + timeout + GRACE;
    loop {
        match rx.recv_timeout(TICK) {
            Ok(result) => return result,
            Err(mpsc::RecvTimeoutError::Disconnected) => return Err(Error::new(op, "the store's call panicked")),
            Err(mpsc::RecvTimeoutError::Timeout) => {}
        }
        if let Some(i) = crate::signals::interruption() {
            return Err(Error::new(op, format!("interrupted by {}", crate::signals::name(i.signal))));
        }
        if Instant::now() >= deadline {
            return Err(Error::new(
                op,
                format!("no answer in {} s: the server accepted the connection but does not reply", fmt_s(timeout)),
            ));
        }
    }
}

/// "5", "0.5".
fn fmt_s(d: Duration) -> String {
    let s = d.as_secs_f64();
    if s.fract() == 0.0 {
        format!("{s:.0}")
    } else {
        format!("{s}")
    }
}

impl Store {
    /// A server that takes over `listener` (already bound, e.g. to 127.0.0.1:0), so nothing
    /// else chooses the address and two runs never race for a port.
    pub fn serve(listener: TcpListener, num_workers: usize, timeout: Duration) -> Result<Store> {
        let addr = listener.local_addr().map_err(|e| Error::new("store.serve", e.to_string()))?;
        let host = CString::new(addr.ip().to_string()).expect("an IP address has no NUL");
        let fd = listener.into_raw_fd();
        Self::open("store.serve".into(), host, addr.port(), true, fd, num_workers, timeout)
    }

    /// A client of the server at `host:port`, retrying until `timeout`.
    pub fn connect(host: &str, port: u16, timeout: Duration) -> Result<Store> {
        let op = format!("store.connect({host}:{port})");
        let host_c = key_c(host, &op)?;
        Self::open(op, host_c, port, false, -1, 0, timeout)
    }

    /// A server listening on `port` of every interface of this host (multi-node rendezvous).
    pub fn listen(port: u16, num_workers: usize, timeout: Duration) -> Result<Store> {
        let host = CString::new("0.0.0.0").unwrap();
        Self::open(format!("store.listen(:{port})"), host, port, true, -1, num_workers, timeout)
    }

    fn open(
        op: String,
        host: CString,
        port: u16,
        server: bool,
        fd: i32,
        workers: usize,
        timeout: Duration,
    ) -> Result<Store> {
        let call_op = op.clone();
        let handle = bounded(&op, timeout, move || {
            let mut raw = std::ptr::null_mut();
            // SAFETY: `host` outlives the call; `raw` is written only on success.
            let err = unsafe {
                ffi::rn_store_new(host.as_ptr(), port, server as i32, fd, workers as i32, ms(timeout), &mut raw)
            };
            check(&call_op, err)?;
            Ok(Arc::new(Handle(NonNull::new(raw).expect("rn_store_new succeeded"))))
        })?;
        Ok(Store { handle, timeout })
    }

    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// A view of this store whose keys all go under `prefix` (c10d's PrefixStore): one attempt
    /// of a job restarted over the same store (torchrun's `--max-restarts`) never reads the keys
    /// of the attempt before.
    pub fn prefixed(&self, prefix: &str) -> Result<Store> {
        let op = format!("store.prefixed({prefix:?})");
        let p = key_c(prefix, &op)?;
        let handle = self.call(op, move |raw, op| {
            let mut out = std::ptr::null_mut();
            // SAFETY: `raw` is a live store (its Arc is held by the caller), `p` outlives the call,
            // and `out` is written only on success.
            check(op, unsafe { ffi::rn_store_prefixed(raw, p.as_ptr(), &mut out) })?;
            Ok(Arc::new(Handle(NonNull::new(out).expect("rn_store_prefixed succeeded"))))
        })?;
        Ok(Store { handle, timeout: self.timeout })
    }

    pub(crate) fn raw(&self) -> *mut ffi::RnStore {
        self.handle.0.as_ptr()
    }

    /// Runs `call` on the store, bounded ([`bounded`]).
    fn call<T: Send + 'static>(
        &self,
        op: String,
        call: impl FnOnce(*mut ffi::RnStore, &str) -> Result<T> + Send + 'static,
    ) -> Result<T> {
        let handle = Arc::clone(&self.handle);
        let call_op = op.clone();
        bounded(&op, self.timeout, move || call(handle.0.as_ptr(), &call_op))
    }

    /// The port the server listens on (the one it was given or the one the OS chose).
    pub fn port(&self) -> Result<u16> {
        self.call("store.port".into(), |raw, op| {
            let mut port = 0u16;
            // SAFETY: `raw` is a live store (its Arc is held by the caller); `port` is a valid out-pointer.
            check(op, unsafe { ffi::rn_store_port(raw, &mut port) })?;
            Ok(port)
        })
    }

    pub fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        let op = format!("store.set({key:?})");
        let k = key_c(key, &op)?;
        let value = value.to_vec();
        self.call(op, move |raw, op| {
            // SAFETY: the key and value buffers are valid for the call; the length is explicit.
            check(op, unsafe { ffi::rn_store_set(raw, k.as_ptr(), value.as_ptr(), value.len()) })
        })
    }

    /// Waits (up to the timeout) until `key` exists, then returns its value.
    pub fn get(&self, key: &str) -> Result<Vec<u8>> {
        let op = format!("store.get({key:?})");
        let k = key_c(key, &op)?;
        self.call(op, move |raw, op| {
            let mut buf = std::ptr::null_mut();
            let mut len = 0usize;
            // SAFETY: out-pointers are valid; on success `buf` holds `len` bytes we must free.
            check(op, unsafe { ffi::rn_store_get(raw, k.as_ptr(), &mut buf, &mut len) })?;
            // SAFETY: `buf` points at `len` initialised bytes allocated by the bridge.
            let value = unsafe { std::slice::from_raw_parts(buf, len) }.to_vec();
            // SAFETY: `buf` came from the bridge's malloc and is freed once.
            unsafe { ffi::rn_free_bytes(buf) };
            Ok(value)
        })
    }

    /// Atomically adds `delta` to the integer at `key` (created at 0) and returns the new value.
    pub fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let op = format!("store.add({key:?})");
        let k = key_c(key, &op)?;
        self.call(op, move |raw, op| {
            let mut out = 0i64;
            // SAFETY: valid key and out-pointer.
            check(op, unsafe { ffi::rn_store_add(raw, k.as_ptr(), delta, &mut out) })?;
            Ok(out)
        })
    }

    /// Whether `key` exists, without waiting.
    pub fn contains(&self, key: &str) -> Result<bool> {
        let op = format!("store.check({key:?})");
        let k = key_c(key, &op)?;
        self.call(op, move |raw, op| {
            let mut present = 0;
            // SAFETY: valid key and out-pointer.
            check(op, unsafe { ffi::rn_store_check(raw, k.as_ptr(), &mut present) })?;
            Ok(present != 0)
        })
    }
}
