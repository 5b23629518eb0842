//! `POST /slots/{id}?action=save|restore|erase`, as llama-server has: a slot's KV cache saved
//! to a file in `--slot-save-path`, restored from one (so a long system prompt's cache survives
//! a restart), or erased. The engine copies the state out or in between two steps (a busy slot
//! is refused); files are written and read here, on the blocking pool, in the format of
//! `slot_file.rs`. One slot file operation runs at a time, so at most one state is in memory.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::{RawQuery, State};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;
use tokio::sync::Semaphore;

use crate::http::error::ApiError;
use crate::http::AppState;
use crate::ops::slot_file::{self, ModelIdentity, SlotFileError};
use crate::protocol::{SlotAction, SlotCommand, SlotOutcome, Token};
use crate::requests::common::{model_info, parse_json};
use crate::requests::validate;

/// One slot file operation at a time (a state can take hundreds of megabytes).
static SLOT_FILES: Semaphore = Semaphore::const_new(1);

/// The `filename` of a save or restore body, which must be a JSON object (serde would also
/// take `["name"]` for a struct).
fn file_name_of(body: &[u8]) -> Result<String, ApiError> {
    let fields: serde_json::Map<String, serde_json::Value> = parse_json(body)?;
    match fields.get("filename") {
        Some(serde_json::Value::String(name)) => Ok(name.clone()),
        None | Some(serde_json::Value::Null) => Err(ApiError::field("filename", " is required")),
        Some(_) => Err(ApiError::field("filename", " must be a string")),
    }
}

/// The three actions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Action {
    Save,
    Restore,
    Erase,
}

/// The `action` of a query string (`action=save`), which must be given once.
fn parse_action(query: Option<&str>) -> Result<Action, ApiError> {
    let mut found = None;
    for pair in query.unwrap_or("").split('&') {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        if key != "action" {
            continue;
        }
        if found.is_some() {
            return Err(ApiError::invalid("give the action once"));
        }
        found = Some(match value {
            "save" => Action::Save,
            "restore" => Action::Restore,
            "erase" => Action::Erase,
            _ => return Err(ApiError::field("action", " must be save, restore or erase")),
        });
    }
    found.ok_or_else(|| ApiError::invalid("the query must give action=save, restore or erase"))
}

/// The slot id of the path, which must name one of this server's slots.
fn parse_slot(id: &str, total: usize) -> Result<usize, ApiError> {
    let slot: usize = id
        .parse()
        .map_err(|_| ApiError::invalid("the slot id must be a non-negative integer"))?;
    if slot >= total {
        return Err(ApiError::SlotNotFound(format!(
            "no slot {slot}: this server has slots 0..{total}"
        )));
    }
    Ok(slot)
}

/// `POST /slots/{id}?action=save|restore|erase`.
pub async fn action(
    State(state): State<AppState>,
    axum::extract::Path(id): axum::extract::Path<String>,
    RawQuery(query): RawQuery,
    body: Bytes,
) -> Result<Response, ApiError> {
    let info = model_info(&state)?;
    let total = usize::try_from(state.engine.health.slots().1).unwrap_or(0);
    let slot = parse_slot(&id, total)?;
    let action = parse_action(query.as_deref())?;
    if action == Action::Erase {
        let n = match run(&state, slot, SlotAction::Erase).await? {
            SlotOutcome::Erased(n) => n,
            other => return Err(unexpected(&other)),
        };
        tracing::info!(slot, tokens = n, "slot cache erased");
        return Ok(Json(json!({"id_slot": slot, "n_erased": n})).into_response());
    }
    let dir = state.slot_save_path.clone().ok_or_else(|| {
        ApiError::NotSupported(
            "slot files are off: start the server with --slot-save-path DIR to save and \
             restore slots"
                .into(),
        )
    })?;
    let name = file_name_of(&body)?;
    slot_file::check_file_name(&name).map_err(ApiError::InvalidRequest)?;
    let _one_at_a_time = SLOT_FILES
        .acquire()
        .await
        .map_err(|e| ApiError::Internal(format!("slot file lock closed: {e}")))?;
    let started = Instant::now();
    let identity = {
        let info = info.clone();
        validate::blocking(move || slot_file::model_identity(&info)).await?
    };
    if action == Action::Save {
        let quota = (dir.clone(), name.clone());
        validate::blocking(move || check_quota(&quota.0, &quota.1))
            .await?
            .map_err(ApiError::InvalidRequest)?;
        let (tokens, saved, lora) = match run(&state, slot, SlotAction::Save).await? {
            SlotOutcome::Saved {
                tokens,
                state,
                lora,
            } => (tokens, state, lora),
            other => return Err(unexpected(&other)),
        };
        // A cache computed under LoRA scales is only restored where those are the defaults.
        let identity = identity.with_lora(&lora, state.lora.len());
        let n_saved = tokens.len();
        let path = dir.join(&name);
        let written = validate::blocking(move || write_file(&path, &identity, &tokens, &saved))
            .await?
            .map_err(|e| ApiError::Internal(format!("cannot write slot file {name}: {e}")))?;
        let ms = started.elapsed().as_secs_f64() * 1000.0;
        tracing::info!(slot, file = %name, tokens = n_saved, bytes = written, "slot saved");
        return Ok(Json(json!({
            "id_slot": slot,
            "filename": name,
            "n_saved": n_saved,
            "n_written": written,
            "timings": {"save_ms": ms},
        }))
        .into_response());
    }
    let path = dir.join(&name);
    let (capacity, n_vocab, max) = (
        info.slot_ctx,
        info.n_vocab,
        slot_file::max_file_bytes(&info),
    );
    // The cache is restored as computed under the default scales: a file saved under others
    // has another identity and is refused.
    let defaults = state.lora.defaults();
    let identity = identity.with_lora(&defaults, state.lora.len());
    let shown = name.clone();
    let (file, n_read) = validate::blocking(move || read_file(&path, &shown, max)).await??;
    let file = slot_file::read(file, &identity, capacity, n_vocab).map_err(|e| match e {
        SlotFileError::TooManyTokens { .. } => ApiError::ContextLength(format!("{name}: {e}")),
        _ => ApiError::InvalidSlotFile(format!("{name}: {e}")),
    })?;
    let restore = SlotAction::Restore {
        tokens: file.tokens,
        state: file.state,
        lora: defaults,
    };
    let n = match run(&state, slot, restore).await {
        Ok(SlotOutcome::Restored(n)) => n,
        Ok(other) => return Err(unexpected(&other)),
        Err(ApiError::InvalidSlotFile(why)) => {
            return Err(ApiError::InvalidSlotFile(format!("{name}: {why}")))
        }
        Err(e) => return Err(e),
    };
    let ms = started.elapsed().as_secs_f64() * 1000.0;
    tracing::info!(slot, file = %name, tokens = n, "slot restored");
    Ok(Json(json!({
        "id_slot": slot,
        "filename": name,
        "n_restored": n,
        "n_read": n_read,
        "timings": {"restore_ms": ms},
    }))
    .into_response())
}

/// Sends a slot operation to the engine and waits for its answer.
async fn run(state: &AppState, slot: usize, action: SlotAction) -> Result<SlotOutcome, ApiError> {
    let (reply, answer) = tokio::sync::oneshot::channel();
    state.engine.submit_slot(SlotCommand {
        slot,
        action,
        reply,
    })?;
    Ok(answer
        .await
        .map_err(|_| ApiError::Unavailable("the engine stopped".into()))??)
}

fn unexpected(outcome: &SlotOutcome) -> ApiError {
    let what = match outcome {
        SlotOutcome::Saved { .. } => "saved",
        SlotOutcome::Restored(_) => "restored",
        SlotOutcome::Erased(_) => "erased",
    };
    ApiError::Internal(format!(
        "the engine answered the wrong slot action ({what})"
    ))
}

/// Most slot files the directory may hold. A save under a name that is not there yet is
/// refused past it (saving over an existing file is always allowed): each file can hold a
/// whole slot's state, and a client naming a new file on every save would fill the disk.
pub const MAX_SLOT_FILES: usize = 256;

/// Checks that saving `name` into `dir` can replace what has that name (not a directory) and
/// keeps the directory within `MAX_SLOT_FILES` slot files (files
/// whose names a request could give; hidden temporaries and others do not count). Runs under
/// the one-at-a-time slot file lock, so two saves cannot both take the last place.
fn check_quota(dir: &Path, name: &str) -> Result<(), String> {
    let path = dir.join(name);
    if path.is_file() {
        return Ok(());
    }
    // A directory of that name cannot be replaced by a file (anything else can: the rename
    // replaces a link itself, not what it points to).
    if std::fs::symlink_metadata(&path).is_ok_and(|m| m.is_dir()) {
        return Err(format!(
            "{name} in the slot save directory is a directory: save under another name"
        ));
    }
    let entries =
        std::fs::read_dir(dir).map_err(|e| format!("cannot read the slot directory: {e}"))?;
    let mut count = 0;
    for entry in entries.flatten() {
        let file_name = entry.file_name();
        let counts = file_name
            .to_str()
            .is_some_and(|n| slot_file::check_file_name(n).is_ok())
            && entry.file_type().is_ok_and(|t| t.is_file());
        if counts {
            count += 1;
            if count >= MAX_SLOT_FILES {
                return Err(format!(
                    "the slot directory holds {MAX_SLOT_FILES} slot files, the most allowed: \
                     save over an existing one, or remove some"
                ));
            }
        }
    }
    Ok(())
}

/// Writes a slot file: to a hidden temporary file beside it first, then renamed over it, so a
/// reader never sees half a file and a failed save leaves the old one.
fn write_file(
    path: &Path,
    identity: &ModelIdentity,
    tokens: &[Token],
    state: &[u8],
) -> std::io::Result<u64> {
    use std::io::Write;
    let tmp = temporary_path(path);
    let written = (|| {
        let file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)?;
        let mut out = std::io::BufWriter::new(file);
        let n = slot_file::write(&mut out, identity, tokens, state)?;
        out.flush()?;
        out.get_ref().sync_all()?;
        std::fs::rename(&tmp, path)?;
        Ok(n)
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

/// `.NAME.PID.RANDOM.tmp` beside `path`: hidden, so no request can name it.
fn temporary_path(path: &Path) -> PathBuf {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    path.with_file_name(format!(
        ".{name}.{}.{:016x}.tmp",
        std::process::id(),
        rand::random::<u64>()
    ))
}

/// Reads a slot file whole, refusing what is not a regular file (a FIFO would block forever)
/// and anything larger than `max` bytes. `shown` names it in errors (never the directory).
fn read_file(path: &Path, shown: &str, max: u64) -> Result<(Vec<u8>, u64), ApiError> {
    use std::io::Read;
    let missing =
        || ApiError::FileNotFound(format!("no slot file {shown} in the slot save directory"));
    let meta = std::fs::metadata(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => missing(),
        _ => ApiError::Internal(format!("cannot read slot file {shown}: {e}")),
    })?;
    if !meta.is_file() {
        return Err(ApiError::InvalidSlotFile(format!(
            "{shown} is not a regular file"
        )));
    }
    if meta.len() > max {
        let e = SlotFileError::TooLarge {
            size: meta.len(),
            max,
        };
        return Err(ApiError::InvalidSlotFile(format!("{shown}: {e}")));
    }
    let file = std::fs::File::open(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => missing(),
        _ => ApiError::Internal(format!("cannot read slot file {shown}: {e}")),
    })?;
    let mut bytes = Vec::with_capacity(usize::try_from(meta.len()).unwrap_or(0));
    file.take(max.saturating_add(1))
        .read_to_end(&mut bytes)
        .map_err(|e| ApiError::Internal(format!("cannot read slot file {shown}: {e}")))?;
    let n = bytes.len() as u64;
    if n > max {
        let e = SlotFileError::TooLarge { size: n, max };
        return Err(ApiError::InvalidSlotFile(format!("{shown}: {e}")));
    }
    Ok((bytes, n))
}

/// The slot save directory, made if missing, as an absolute path (`--slot-save-path`).
pub fn prepare_dir(dir: &Path) -> Result<Arc<Path>, String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("cannot create it: {e}"))?;
    let dir = dir
        .canonicalize()
        .map_err(|e| format!("cannot resolve it: {e}"))?;
    if !dir.is_dir() {
        return Err("not a directory".into());
    }
    Ok(Arc::from(dir))
}

/// `GET /slots`: an array, as llama-server's (whose tools read it), of each slot's id, busy
/// flag, cached tokens and last use, and what its request is doing: phase, prompt tokens
/// (cached, processed), tokens generated, paused for its client; with llama-server's names for
/// what it has too (`is_processing`, `n_ctx`).
pub async fn list(State(state): State<AppState>) -> Response {
    let n_ctx = state.engine.health.model_info().map(|info| info.slot_ctx);
    let slots: Vec<serde_json::Value> = state
        .engine
        .health
        .slot_table()
        .into_iter()
        .map(|slot| {
            let busy = slot.busy;
            let mut entry = json!(slot);
            entry["is_processing"] = json!(busy);
            entry["n_ctx"] = json!(n_ctx);
            entry
        })
        .collect();
    Json(slots).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn actions_come_from_the_query() {
        assert_eq!(parse_action(Some("action=save")).unwrap(), Action::Save);
        assert_eq!(
            parse_action(Some("x=1&action=restore")).unwrap(),
            Action::Restore
        );
        assert_eq!(parse_action(Some("action=erase")).unwrap(), Action::Erase);
        for bad in [
            None,
            Some(""),
            Some("action="),
            Some("action=delete"),
            Some("action=save&action=erase"),
            Some("Action=save"),
        ] {
            assert!(parse_action(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn the_file_name_comes_from_a_json_object() {
        assert_eq!(file_name_of(br#"{"filename":"a.bin"}"#).unwrap(), "a.bin");
        for (body, kind) in [
            (&br#"["a.bin"]"#[..], "invalid_json"),
            (br#""a.bin""#, "invalid_json"),
            (b"{", "invalid_json"),
            (b"{}", "invalid_request"),
            (br#"{"filename":null}"#, "invalid_request"),
            (br#"{"filename":5}"#, "invalid_request"),
        ] {
            assert_eq!(file_name_of(body).unwrap_err().kind(), kind, "{body:?}");
        }
    }

    #[test]
    fn slot_ids_are_checked() {
        assert_eq!(parse_slot("0", 2).unwrap(), 0);
        assert_eq!(parse_slot("1", 2).unwrap(), 1);
        assert_eq!(parse_slot("2", 2).unwrap_err().kind(), "slot_not_found");
        for bad in ["-1", "x", "", "1.0", "99999999999999999999999"] {
            assert_eq!(
                parse_slot(bad, 2).unwrap_err().kind(),
                "invalid_request",
                "{bad}"
            );
        }
    }

    #[test]
    fn new_slot_files_are_refused_past_the_quota() {
        let dir = std::env::temp_dir().join(format!("llamarunner-quota-{}", std::process::id()));
        let dir = prepare_dir(&dir).unwrap();
        for i in 0..MAX_SLOT_FILES - 1 {
            std::fs::write(dir.join(format!("f{i}.bin")), b"x").unwrap();
        }
        // Hidden files (a save's temporaries) do not count.
        std::fs::write(dir.join(".tmp.1.tmp"), b"x").unwrap();
        assert_eq!(check_quota(&dir, "new.bin"), Ok(()));
        std::fs::write(dir.join("new.bin"), b"x").unwrap();
        let err = check_quota(&dir, "another.bin").unwrap_err();
        assert!(err.contains("256 slot files"), "{err}");
        // Saving over an existing file is always allowed.
        assert_eq!(check_quota(&dir, "f3.bin"), Ok(()));
        std::fs::remove_dir_all(&*dir).unwrap();
    }

    #[test]
    fn a_save_replaces_the_file_whole_and_leaves_no_temporary() {
        let dir = std::env::temp_dir().join(format!("llamarunner-slots-{}", std::process::id()));
        let dir = prepare_dir(&dir).unwrap();
        let id = slot_file::model_identity(&crate::backend::fake::model_info(64));
        let path = dir.join("a.bin");
        let n = write_file(&path, &id, &[1, 2], b"one").unwrap();
        let n2 = write_file(&path, &id, &[1, 2, 3], b"two").unwrap();
        let (bytes, read) = read_file(&path, "a.bin", 1 << 20).unwrap();
        assert_eq!((read, n2), (bytes.len() as u64, bytes.len() as u64));
        assert!(n < n2);
        let file = slot_file::read(bytes, &id, 64, 258).unwrap();
        assert_eq!(file.tokens, [1, 2, 3]);
        let names: Vec<_> = std::fs::read_dir(&*dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["a.bin"]);
        assert_eq!(
            read_file(&dir.join("none.bin"), "none.bin", 1 << 20)
                .unwrap_err()
                .kind(),
            "file_not_found"
        );
        assert_eq!(
            read_file(&path, "a.bin", 8).unwrap_err().kind(),
            "invalid_slot_file"
        );
        assert_eq!(
            read_file(&dir, "dir", 1 << 20).unwrap_err().kind(),
            "invalid_slot_file"
        );
        std::fs::remove_dir_all(&*dir).unwrap();
    }
}
