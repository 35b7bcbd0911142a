//! The part of UCP's C API (UCX ≥ 1.10, checked against the 1.13 headers) this crate
//! calls, resolved from `libucp.so.0` at run time so that nothing needs UCX to build.
//!
//! Parameter structs are declared to their full size; only the leading fields named in
//! each `field_mask` are read by UCX, and the rest stays zero.

use std::ffi::{c_char, c_int, c_uint, c_void};

/// `ucs_status_t`: a packed enum, one signed byte.
pub type Status = i8;
pub const UCS_OK: Status = 0;
pub const UCS_INPROGRESS: Status = 1;
pub const UCS_ERR_UNREACHABLE: Status = -6;
pub const UCS_ERR_BUSY: Status = -15;
/// `UCS_ERR_LAST`: status pointers in `[-100, -1]` are errors.
const UCS_ERR_LAST: isize = -100;

pub type Handle = *mut c_void;

pub const UCP_PARAM_FIELD_FEATURES: u64 = 1 << 0;
pub const UCP_FEATURE_TAG: u64 = 1 << 0;
pub const UCP_FEATURE_WAKEUP: u64 = 1 << 4;
pub const UCP_EP_PARAM_FIELD_REMOTE_ADDRESS: u64 = 1 << 0;
pub const UCP_OP_ATTR_FIELD_FLAGS: u32 = 1 << 4;
pub const UCP_EP_CLOSE_FLAG_FORCE: u32 = 1 << 0;

/// `ucp_params_t` (80 bytes).
#[repr(C)]
pub struct Params {
    pub field_mask: u64,
    pub features: u64,
    pub rest: [u64; 8],
}

/// `ucp_worker_params_t` (200 bytes); only the thread mode is set.
#[repr(C)]
pub struct WorkerParams {
    pub field_mask: u64,
    pub thread_mode: c_int,
    pub rest: [u32; 47],
}

pub const UCP_WORKER_PARAM_FIELD_THREAD_MODE: u64 = 1 << 0;
/// `UCS_THREAD_MODE_SERIALIZED`: any thread, one at a time.
pub const UCS_THREAD_MODE_SERIALIZED: c_int = 1;

/// `ucp_ep_params_t` (104 bytes).
#[repr(C)]
pub struct EpParams {
    pub field_mask: u64,
    pub address: *const c_void,
    pub err_mode: c_int,
    pub err_handler_cb: *mut c_void,
    pub err_handler_arg: *mut c_void,
    pub user_data: *mut c_void,
    pub flags: c_uint,
    pub rest: [u32; 13],
}

/// `ucp_request_param_t` (72 bytes). No callback is ever set: requests are polled with
/// `ucp_request_check_status`.
#[repr(C)]
pub struct RequestParam {
    pub op_attr_mask: u32,
    pub flags: u32,
    pub request: *mut c_void,
    pub cb: *mut c_void,
    pub datatype: u64,
    pub user_data: *mut c_void,
    pub reply_buffer: *mut c_void,
    pub memory_type: c_int,
    pub recv_info: *mut c_void,
    pub memh: *mut c_void,
}

impl RequestParam {
    pub fn none() -> Self {
        RequestParam {
            op_attr_mask: 0,
            flags: 0,
            request: std::ptr::null_mut(),
            cb: std::ptr::null_mut(),
            datatype: 0,
            user_data: std::ptr::null_mut(),
            reply_buffer: std::ptr::null_mut(),
            memory_type: 0,
            recv_info: std::ptr::null_mut(),
            memh: std::ptr::null_mut(),
        }
    }
}

/// `ucp_tag_recv_info_t`.
#[repr(C)]
pub struct TagRecvInfo {
    pub sender_tag: u64,
    pub length: usize,
}

/// What a status pointer (`ucs_status_ptr_t`) says.
pub enum StatusPtr {
    /// Done at once.
    Done,
    /// Still running: poll and free this request.
    Pending(Handle),
    Failed(Status),
}

pub fn status_ptr(p: Handle) -> StatusPtr {
    let v = p as isize;
    if p.is_null() {
        StatusPtr::Done
    } else if (UCS_ERR_LAST..0).contains(&v) {
        StatusPtr::Failed(v as Status)
    } else {
        StatusPtr::Pending(p)
    }
}

macro_rules! api {
    ($($field:ident = $sym:literal : fn($($arg:ty),*) $(-> $ret:ty)?;)*) => {
        /// The resolved entry points. The library stays loaded for the life of the process.
        pub struct Api {
            $(pub $field: unsafe extern "C" fn($($arg),*) $(-> $ret)?,)*
            _lib: libloading::Library,
        }

        impl Api {
            /// Load `libucp.so.0` and resolve every entry point, or say which one is missing.
            pub fn load() -> Result<Api, String> {
                // SAFETY: loading runs libucp's (and libucs') initialisers, which are
                // ordinary C library constructors with no requirement on our state.
                let lib = unsafe { libloading::Library::new("libucp.so.0") }.map_err(|e| e.to_string())?;
                $(
                    // SAFETY: the symbol's C signature (UCX 1.13 headers) is the one
                    // declared here; the pointer is copied out and `lib` is kept alive
                    // in the same struct for as long as the pointer can be called.
                    let $field = unsafe {
                        *lib.get::<unsafe extern "C" fn($($arg),*) $(-> $ret)?>(concat!($sym, "\0").as_bytes())
                            .map_err(|e| format!("{}: {e}", $sym))?
                    };
                )*
                Ok(Api { $($field,)* _lib: lib })
            }
        }
    };
}

api! {
    get_version = "ucp_get_version": fn(*mut c_uint, *mut c_uint, *mut c_uint);
    config_read = "ucp_config_read": fn(*const c_char, *const c_char, *mut Handle) -> Status;
    config_modify = "ucp_config_modify": fn(Handle, *const c_char, *const c_char) -> Status;
    config_release = "ucp_config_release": fn(Handle);
    init_version = "ucp_init_version": fn(c_uint, c_uint, *const Params, Handle, *mut Handle) -> Status;
    cleanup = "ucp_cleanup": fn(Handle);
    worker_create = "ucp_worker_create": fn(Handle, *const WorkerParams, *mut Handle) -> Status;
    worker_destroy = "ucp_worker_destroy": fn(Handle);
    worker_get_address = "ucp_worker_get_address": fn(Handle, *mut Handle, *mut usize) -> Status;
    worker_release_address = "ucp_worker_release_address": fn(Handle, Handle);
    worker_progress = "ucp_worker_progress": fn(Handle) -> c_uint;
    worker_get_efd = "ucp_worker_get_efd": fn(Handle, *mut c_int) -> Status;
    worker_arm = "ucp_worker_arm": fn(Handle) -> Status;
    ep_create = "ucp_ep_create": fn(Handle, *const EpParams, *mut Handle) -> Status;
    ep_close_nbx = "ucp_ep_close_nbx": fn(Handle, *const RequestParam) -> Handle;
    ep_print_info = "ucp_ep_print_info": fn(Handle, *mut libc::FILE);
    tag_send_nbx = "ucp_tag_send_nbx": fn(Handle, *const c_void, usize, u64, *const RequestParam) -> Handle;
    tag_probe_nb = "ucp_tag_probe_nb": fn(Handle, u64, u64, c_int, *mut TagRecvInfo) -> Handle;
    tag_msg_recv_nbx = "ucp_tag_msg_recv_nbx": fn(Handle, *mut c_void, usize, Handle, *const RequestParam) -> Handle;
    request_check_status = "ucp_request_check_status": fn(Handle) -> Status;
    request_cancel = "ucp_request_cancel": fn(Handle, Handle);
    request_free = "ucp_request_free": fn(Handle);
    status_string = "ucs_status_string": fn(Status) -> *const c_char;
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The sizes the UCX 1.13 headers give (checked with `offsetof`/`sizeof` against them).
    #[test]
    fn struct_sizes_match_the_headers() {
        assert_eq!(std::mem::size_of::<Params>(), 80);
        assert_eq!(std::mem::size_of::<WorkerParams>(), 200);
        assert_eq!(std::mem::offset_of!(WorkerParams, thread_mode), 8);
        assert_eq!(std::mem::size_of::<EpParams>(), 104);
        assert_eq!(std::mem::offset_of!(EpParams, err_mode), 16);
        assert_eq!(std::mem::offset_of!(EpParams, err_handler_cb), 24);
        assert_eq!(std::mem::offset_of!(EpParams, flags), 48);
        assert_eq!(std::mem::size_of::<RequestParam>(), 72);
        assert_eq!(std::mem::offset_of!(RequestParam, datatype), 24);
        assert_eq!(std::mem::size_of::<TagRecvInfo>(), 16);
    }

    #[test]
    fn status_pointers() {
        assert!(matches!(status_ptr(std::ptr::null_mut()), StatusPtr::Done));
        assert!(matches!(status_ptr(-6isize as Handle), StatusPtr::Failed(UCS_ERR_UNREACHABLE)));
        assert!(matches!(status_ptr(-100isize as Handle), StatusPtr::Failed(-100)));
        assert!(matches!(status_ptr(0x1000 as Handle), StatusPtr::Pending(_)));
    }
}
