//! One model's engine in its own process: a `llamarunner` server on a loopback port, started
//! with the router's `engine_command` and its configuration in the environment. A llama.cpp
//! abort there ends that process only. A task per process reports its load progress (from
//! its `/health`), its readiness and its exit.

use std::net::TcpListener;
use std::process::Stdio;
use std::time::Duration;

use serde_json::Value;
use tokio::sync::{mpsc, oneshot};

use super::engine_client;
use crate::protocol::devices::DeviceFacts;

/// The environment variable that carries an engine's configuration (JSON `RunnerConfig`).
pub const CONFIG_ENV: &str = "LLAMARUNNER_ENGINE_CONFIG";

/// How often a loading engine's `/health` is asked.
const HEALTH_POLL: Duration = Duration::from_millis(50);

/// How long an engine's stderr may stay open after it exited (a process it started could
/// hold it) before its exit is reported without what it said last.
const STDERR_END: Duration = Duration::from_secs(1);

/// The most bytes of an engine's stderr read as one line.
const MAX_LINE: u64 = 64 * 1024;

/// The most bytes of an engine's last reason kept (it goes into errors and `/models`).
const MAX_REASON: usize = 1024;

/// Passes an engine's stderr on to the router's, line by line, and returns the reason the
/// engine gave last (`llamarunner: model NAME: REASON`, which `_engine.py` writes before it
/// exits on a failure): an engine that fails before it serves `/health`, for example on a
/// file that is not a GGUF model, has no other way to say why.
async fn pass_stderr(stderr: Option<tokio::process::ChildStderr>, name: String) -> Option<String> {
    use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};
    let mut lines = tokio::io::BufReader::new(stderr?);
    let mut out = tokio::io::stderr();
    let prefix = format!("llamarunner: model {name}: ");
    let mut said = None;
    let mut line = Vec::new();
    loop {
        line.clear();
        // Bytes, not text: a line that is not UTF-8 must not stop the reading (the engine
        // would block on a full pipe). A longer line than MAX_LINE passes in pieces.
        match (&mut lines)
            .take(MAX_LINE)
            .read_until(b'\n', &mut line)
            .await
        {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
        let _ = out.write_all(&line).await;
        let text = String::from_utf8_lossy(&line);
        if let Some(why) = text.trim_end().strip_prefix(&prefix) {
            said = Some(crate::http::text::truncated(why, MAX_REASON).to_string());
        }
    }
    said
}

/// How an engine process ended.
#[derive(Debug)]
pub struct Exit {
    /// The router killed it (unload, shutdown).
    pub asked: bool,
    /// What it said, or how it ended.
    pub error: String,
}

/// What the task following a process reports.
#[derive(Debug)]
pub enum Event {
    /// Load progress, 0..1.
    Progress(f32),
    /// Serving on this port, with the model placed on these devices (its `/props`'
    /// `devices`; None when it does not say).
    Ready(u16, Option<DeviceFacts>),
    /// The process has ended.
    Exited(Exit),
}

/// A started engine process. Dropping it kills the process.
#[derive(Debug)]
pub struct EngineProcess {
    /// Its loopback port.
    pub port: u16,
    /// Its process id.
    pub pid: u32,
    kill: Option<oneshot::Sender<()>>,
}

impl EngineProcess {
    /// Starts an engine for `config` (the port is chosen here). The events tell how it goes.
    pub fn spawn(
        command: &[String],
        config: &Value,
        name: &str,
    ) -> Result<(Self, mpsc::Receiver<Event>), String> {
        let (program, args) = command
            .split_first()
            .ok_or_else(|| "no engine command is configured".to_string())?;
        let port = free_port().map_err(|e| format!("no free loopback port: {e}"))?;
        let mut config = config.clone();
        if let Some(c) = config.as_object_mut() {
            c.insert("port".into(), Value::from(port));
        }
        let key = config["api_key"][0]
            .as_str()
            .unwrap_or_default()
            .to_string();
        let mut child = tokio::process::Command::new(program)
            .args(args)
            .env(CONFIG_ENV, config.to_string())
            .env("LLAMARUNNER_ENGINE_NAME", name)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| format!("cannot start the engine process ({program}): {e}"))?;
        let pid = child.id().unwrap_or(0);
        let mut said = tokio::spawn(pass_stderr(child.stderr.take(), name.to_string()));
        let (tx, rx) = mpsc::channel(16);
        let (kill_tx, mut kill_rx) = oneshot::channel::<()>();
        tokio::spawn(async move {
            let mut ready = false;
            let mut last_error: Option<String> = None;
            let mut poll = tokio::time::interval(HEALTH_POLL);
            let exit = loop {
                tokio::select! {
                    status = child.wait() => {
                        let how = match status {
                            Ok(s) => s.to_string(),
                            Err(e) => e.to_string(),
                        };
                        // What it said last, once its stderr has ended (it says it
                        // before it exits: a second is more than enough).
                        let said = tokio::time::timeout(STDERR_END, &mut said)
                            .await
                            .ok()
                            .and_then(Result::ok)
                            .flatten();
                        let error = match last_error.take().or(said) {
                            Some(e) => format!("the model's engine failed: {e} ({how})"),
                            None if ready => format!("the model's engine process ended ({how})"),
                            None => format!("the model's engine process ended while loading ({how})"),
                        };
                        break Exit { asked: false, error };
                    }
                    _ = &mut kill_rx => {
                        let _ = child.start_kill();
                        let _ = child.wait().await;
                        break Exit { asked: true, error: "unloaded".into() };
                    }
                    _ = poll.tick(), if !ready => {
                        match engine_client::engine_health(port, &key).await {
                            Some((true, _, _)) => {
                                ready = true;
                                let devices = engine_client::engine_devices(port, &key).await;
                                let _ = tx.send(Event::Ready(port, devices)).await;
                            }
                            Some((false, progress, error)) => {
                                if error.is_some() {
                                    last_error = error;
                                }
                                let _ = tx.send(Event::Progress(progress)).await;
                            }
                            None => {}
                        }
                    }
                }
            };
            let _ = tx.send(Event::Exited(exit)).await;
        });
        Ok((
            Self {
                port,
                pid,
                kill: Some(kill_tx),
            },
            rx,
        ))
    }

    /// Kills the process (its task reports the exit).
    pub fn kill(mut self) {
        if let Some(k) = self.kill.take() {
            let _ = k.send(());
        }
    }

    /// The process's resident memory, from /proc (Linux).
    pub fn rss_bytes(&self) -> Option<u64> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid)).ok()?;
        let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
        let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
        Some(kb * 1024)
    }
}

impl Drop for EngineProcess {
    fn drop(&mut self) {
        if let Some(k) = self.kill.take() {
            let _ = k.send(());
        }
    }
}

/// A loopback port free now (the engine binds it a moment later; another process taking it in
/// between makes that load fail, and the next request loads again).
fn free_port() -> std::io::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}
