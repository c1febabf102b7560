//! `Store`: c10d's TCPStore, the key-value rendezvous every rank meets at.
use std::ffi::CString;
use std::net::TcpListener;
use std::os::fd::IntoRawFd;
use std::ptr::NonNull;
use std::time::Duration;

use super::error::{Error, Result};
use super::{check, ffi};

/// A TCPStore server or client. Every operation is bounded by the store's timeout.
pub struct Store {
    raw: NonNull<ffi::RnStore>,
    timeout: Duration,
}

// SAFETY: c10d::TCPStore serialises its client socket behind a mutex; it may be used from any thread.
unsafe impl Send for Store {}
// SAFETY: as above, every method takes the store's own lock.
unsafe impl Sync for Store {}

fn ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

fn key_c(key: &str, op: &str) -> Result<CString> {
    CString::new(key).map_err(|_| Error::new(op, format!("key {key:?} contains a NUL byte")))
}

impl Store {
    /// A server that takes over `listener` (already bound, e.g. to 127.0.0.1:0), so nothing
    /// else chooses the address and two runs never race for a port.
    pub fn serve(listener: TcpListener, num_workers: usize, timeout: Duration) -> Result<Store> {
        let addr = listener.local_addr().map_err(|e| Error::new("store.serve", e.to_string()))?;
        let host = CString::new(addr.ip().to_string()).expect("an IP address has no NUL");
        let fd = listener.into_raw_fd();
        Self::open("store.serve", &host, addr.port(), true, fd, num_workers, timeout)
    }

    /// A client of the server at `host:port`, retrying until `timeout`.
    pub fn connect(host: &str, port: u16, timeout: Duration) -> Result<Store> {
        let host_c = key_c(host, "store.connect")?;
        Self::open(&format!("store.connect({host}:{port})"), &host_c, port, false, -1, 0, timeout)
    }

    /// A server listening on `port` of every interface of this host (multi-node rendezvous).
    pub fn listen(port: u16, num_workers: usize, timeout: Duration) -> Result<Store> {
        let host = CString::new("0.0.0.0").unwrap();
        Self::open(&format!("store.listen(:{port})"), &host, port, true, -1, num_workers, timeout)
    }

    fn open(
        op: &str,
        host: &CString,
        port: u16,
        server: bool,
        fd: i32,
        workers: usize,
        timeout: Duration,
    ) -> Result<Store> {
        let mut raw = std::ptr::null_mut();
        // SAFETY: `host` outlives the call; `raw` is written only on success.
        let err =
            unsafe { ffi::rn_store_new(host.as_ptr(), port, server as i32, fd, workers as i32, ms(timeout), &mut raw) };
        check(op, err)?;
        Ok(Store { raw: NonNull::new(raw).expect("rn_store_new succeeded"), timeout })
    }

    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    pub(crate) fn raw(&self) -> *mut ffi::RnStore {
        self.raw.as_ptr()
    }

    /// The port the server listens on (the one it was given or the one the OS chose).
    pub fn port(&self) -> Result<u16> {
        let mut port = 0u16;
        // SAFETY: `self.raw` is a live store; `port` is a valid out-pointer.
        check("store.port", unsafe { ffi::rn_store_port(self.raw(), &mut port) })?;
        Ok(port)
    }

    pub fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        let op = format!("store.set({key:?})");
        let k = key_c(key, &op)?;
        // SAFETY: the key and value buffers are valid for the call; the length is explicit.
        check(&op, unsafe { ffi::rn_store_set(self.raw(), k.as_ptr(), value.as_ptr(), value.len()) })
    }

    /// Waits (up to the timeout) until `key` exists, then returns its value.
    pub fn get(&self, key: &str) -> Result<Vec<u8>> {
        let op = format!("store.get({key:?})");
        let k = key_c(key, &op)?;
        let mut buf = std::ptr::null_mut();
        let mut len = 0usize;
        // SAFETY: out-pointers are valid; on success `buf` holds `len` bytes we must free.
        check(&op, unsafe { ffi::rn_store_get(self.raw(), k.as_ptr(), &mut buf, &mut len) })?;
        // SAFETY: `buf` points at `len` initialised bytes allocated by the bridge.
        let value = unsafe { std::slice::from_raw_parts(buf, len) }.to_vec();
        // SAFETY: `buf` came from the bridge's malloc and is freed once.
        unsafe { ffi::rn_free_bytes(buf) };
        Ok(value)
    }

    /// Atomically adds `delta` to the integer at `key` (created at 0) and returns the new value.
    pub fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let op = format!("store.add({key:?})");
        let k = key_c(key, &op)?;
        let mut out = 0i64;
        // SAFETY: valid key and out-pointer.
        check(&op, unsafe { ffi::rn_store_add(self.raw(), k.as_ptr(), delta, &mut out) })?;
        Ok(out)
    }

    /// Whether `key` exists, without waiting.
    pub fn contains(&self, key: &str) -> Result<bool> {
        let op = format!("store.check({key:?})");
        let k = key_c(key, &op)?;
        let mut present = 0;
        // SAFETY: valid key and out-pointer.
        check(&op, unsafe { ffi::rn_store_check(self.raw(), k.as_ptr(), &mut present) })?;
        Ok(present != 0)
    }
}

impl Drop for Store {
    fn drop(&mut self) {
        // SAFETY: the handle is live and dropped exactly once.
        unsafe { ffi::rn_store_free(self.raw.as_ptr()) }
    }
}
