//! A GGUF file's metadata (its key-value pairs and tensor count), read with ggml's own GGUF
//! reader without loading a tensor: `llamarunner show` and `llamarunner list`.

use std::ffi::{CStr, CString};
use std::path::Path;

use llama_cpp_sys_2 as sys;
use serde_json::{Map, Value};

/// Arrays longer than this are given as their element type and length only (a vocabulary is
/// hundreds of thousands of strings).
const MAX_ARRAY: usize = 64;

// GGUF's value types (gguf.h).
const UINT8: u32 = 0;
const INT8: u32 = 1;
const UINT16: u32 = 2;
const INT16: u32 = 3;
const UINT32: u32 = 4;
const INT32: u32 = 5;
const FLOAT32: u32 = 6;
const BOOL: u32 = 7;
const STRING: u32 = 8;
const ARRAY: u32 = 9;
const UINT64: u32 = 10;
const INT64: u32 = 11;
const FLOAT64: u32 = 12;

/// Frees the reader's context however the reading ends.
struct Gguf(*mut sys::gguf_context);

impl Drop for Gguf {
    fn drop(&mut self) {
        // SAFETY: a context `gguf_init_from_file` made, freed once.
        unsafe { sys::gguf_free(self.0) }
    }
}

fn type_name(t: u32) -> String {
    // SAFETY: ggml returns a static string for every type (and for unknown ones).
    let name = unsafe { sys::gguf_type_name(t) };
    if name.is_null() {
        return "unknown".into();
    }
    // SAFETY: a NUL-terminated static string.
    unsafe { CStr::from_ptr(name) }
        .to_string_lossy()
        .into_owned()
}

fn float(x: f64) -> Value {
    serde_json::Number::from_f64(x).map_or(Value::Null, Value::Number)
}

/// One element of an array of numbers or booleans (`data` points at the array's first).
///
/// SAFETY: `data` holds at least `i + 1` elements of type `t`.
unsafe fn element(data: *const std::ffi::c_void, t: u32, i: usize) -> Value {
    match t {
        UINT8 => Value::from(*data.cast::<u8>().add(i)),
        INT8 => Value::from(*data.cast::<i8>().add(i)),
        UINT16 => Value::from(*data.cast::<u16>().add(i)),
        INT16 => Value::from(*data.cast::<i16>().add(i)),
        UINT32 => Value::from(*data.cast::<u32>().add(i)),
        INT32 => Value::from(*data.cast::<i32>().add(i)),
        FLOAT32 => float(f64::from(*data.cast::<f32>().add(i))),
        BOOL => Value::from(*data.cast::<u8>().add(i) != 0),
        UINT64 => Value::from(*data.cast::<u64>().add(i)),
        INT64 => Value::from(*data.cast::<i64>().add(i)),
        FLOAT64 => float(*data.cast::<f64>().add(i)),
        _ => Value::Null,
    }
}

fn string(ptr: *const std::os::raw::c_char) -> Value {
    if ptr.is_null() {
        return Value::Null;
    }
    // SAFETY: ggml's strings are NUL-terminated and live as long as the context.
    Value::from(
        unsafe { CStr::from_ptr(ptr) }
            .to_string_lossy()
            .into_owned(),
    )
}

fn value(g: &Gguf, id: i64) -> Value {
    let ctx = g.0;
    // SAFETY: `id` is below `gguf_get_n_kv`, and each getter is called for its own type.
    unsafe {
        match sys::gguf_get_kv_type(ctx, id) {
            STRING => string(sys::gguf_get_val_str(ctx, id)),
            ARRAY => {
                let t = sys::gguf_get_arr_type(ctx, id);
                let n = sys::gguf_get_arr_n(ctx, id);
                if n > MAX_ARRAY || t == ARRAY {
                    let mut m = Map::new();
                    m.insert("array_of".into(), Value::from(type_name(t)));
                    m.insert("length".into(), Value::from(n));
                    return Value::Object(m);
                }
                if t == STRING {
                    return Value::Array(
                        (0..n)
                            .map(|i| string(sys::gguf_get_arr_str(ctx, id, i)))
                            .collect(),
                    );
                }
                let data = sys::gguf_get_arr_data(ctx, id);
                if data.is_null() {
                    return Value::Null;
                }
                Value::Array((0..n).map(|i| element(data, t, i)).collect())
            }
            t => {
                let data = sys::gguf_get_val_data(ctx, id);
                if data.is_null() {
                    Value::Null
                } else {
                    element(data, t, 0)
                }
            }
        }
    }
}

/// The metadata of the GGUF file at `path`: every key with its value (long arrays as
/// `{"array_of": TYPE, "length": N}`), and `tensor_count`. Fails on a file that is not GGUF
/// (ggml's reader checks the header and every length against the file's size).
pub fn gguf_metadata(path: &Path) -> Result<Map<String, Value>, String> {
    let c_path = CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|_| format!("{}: a path with a NUL byte", path.display()))?;
    let params = sys::gguf_init_params {
        no_alloc: true,
        ctx: std::ptr::null_mut(),
    };
    // SAFETY: a NUL-terminated path; with no ggml context asked for, no tensor data is read.
    let ctx = unsafe { sys::gguf_init_from_file(c_path.as_ptr(), params) };
    if ctx.is_null() {
        return Err(format!(
            "{}: not a GGUF file (or one ggml cannot read)",
            path.display()
        ));
    }
    let g = Gguf(ctx);
    let mut out = Map::new();
    // SAFETY: a live context.
    let (n_kv, n_tensors) = unsafe { (sys::gguf_get_n_kv(g.0), sys::gguf_get_n_tensors(g.0)) };
    for id in 0..n_kv {
        // SAFETY: `id` is below `n_kv`.
        let key = string(unsafe { sys::gguf_get_key(g.0, id) });
        if let Value::String(key) = key {
            out.insert(key, value(&g, id));
        }
    }
    out.insert("tensor_count".into(), Value::from(n_tensors));
    Ok(out)
}
