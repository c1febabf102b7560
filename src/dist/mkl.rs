//! MKL's code branch in this process, set and read through MKL's own entry points. libtorch links
//! oneMKL statically and exports the functions behind `mkl_cbwr_set` and `mkl_cbwr_get`
//! (`mkl_serv_cbwr_set`, `mkl_serv_cbwr_get`); they are looked up at run time, so that a
//! libtorch without them only leaves the caller to its fallback.
use std::ffi::{c_char, c_int, c_void, CStr};

/// `MKL_CBWR_BRANCH`: the query of `mkl_cbwr_get` for the branch in effect.
const BRANCH: c_int = 1;
/// `MKL_CBWR_COMPATIBLE`.
const COMPATIBLE: c_int = 3;

fn symbol(name: &CStr) -> Option<extern "C" fn(c_int) -> c_int> {
    // SAFETY: dlsym only looks a NUL-terminated name up in the process's global scope (libtorch_cpu.so
    // is a direct dependency of the executable, so its exported symbols are there).
    let f: *mut c_void = unsafe { nix::libc::dlsym(nix::libc::RTLD_DEFAULT, name.as_ptr() as *const c_char) };
    // SAFETY: both MKL functions take one int and return an int (mkl_cbwr.h's mkl_cbwr_set and
    // mkl_cbwr_get, whose bodies they are); a null pointer is not transmuted.
    (!f.is_null()).then(|| unsafe { std::mem::transmute::<*mut c_void, extern "C" fn(c_int) -> c_int>(f) })
}

/// Puts this process on MKL's COMPATIBLE branch (the same bits on any x86-64 CPU); true when MKL
/// then reports that branch. It works only before MKL has computed anything in the process.
pub fn set_compatible() -> bool {
    let (Some(set), Some(get)) = (symbol(c"mkl_serv_cbwr_set"), symbol(c"mkl_serv_cbwr_get")) else {
        return false;
    };
    set(COMPATIBLE) == 0 && get(BRANCH) == COMPATIBLE
}
