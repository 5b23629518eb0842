//! The models a router serves and the state of each: unloaded, loading, loaded (its engine
//! process and port) or failed. Loading is on demand and happens once however many requests
//! ask at the same moment; `--models-max` bounds the models loaded at once, the least recently
//! used idle one giving way; a model's `keep_alive` unloads it when it has been idle that long.
//! A request holds a `Lease` on its model while it runs, so that a busy model is never the one
//! unloaded to make room.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime};

use serde_json::{json, Value};
use tokio::sync::watch;

use super::engine_process::{EngineProcess, Exit};
use super::ModelSpec;
use crate::config::RunnerConfig;
use crate::http::error::ApiError;
use crate::protocol::memory_estimate as estimate;

/// Where a model stands.
#[derive(Clone, Debug, PartialEq)]
pub enum Status {
    /// Not running (never loaded, unloaded, or expired).
    Unloaded,
    /// Its engine process is starting and loading the weights.
    Loading {
        /// When the load began.
        since: Instant,
        /// The load's progress, 0..1, as the engine's `/health` reports it.
        progress: f32,
    },
    /// Serving on `port`.
    Loaded {
        /// The engine process's loopback port.
        port: u16,
    },
    /// The last load failed, or the engine process died; the next request loads it again.
    Failed {
        /// What went wrong.
        error: String,
    },
}

impl Status {
    /// llama-server's router names for the status (`GET /models`).
    pub fn as_str(&self) -> &'static str {
        match self {
            Status::Unloaded => "unloaded",
            Status::Loading { .. } => "loading",
            Status::Loaded { .. } => "loaded",
            Status::Failed { .. } => "failed",
        }
    }

    fn occupies(&self) -> bool {
        matches!(self, Status::Loading { .. } | Status::Loaded { .. })
    }
}

/// What changes together under a model's lock.
struct Inner {
    status: Status,
    process: Option<EngineProcess>,
    /// Counts the processes started, so that news from an old one is not taken for the
    /// current one's.
    generation: u64,
    /// Requests running on the model.
    in_flight: usize,
    /// When the last request ended (or the load began).
    last_used: Instant,
    /// How long the model stays loaded once idle; None = until the server stops.
    keep_alive: Option<Duration>,
    /// The host memory its load was estimated to take (`--models-memory`), set when it loads:
    /// all of `breakdown` until its engine says where the layers went, then what stayed in
    /// host memory.
    estimate: Option<u64>,
    /// The estimate in parts, set when it loads.
    breakdown: Option<estimate::Estimate>,
    /// Bytes of its weights its engine placed on GPUs (Ollama's `size_vram`), once loaded.
    vram_bytes: u64,
}

/// One model the router serves.
pub struct Model {
    /// The name requests use.
    pub name: String,
    spec: ModelSpec,
    inner: Mutex<Inner>,
    /// Bumped whenever the status changes: requests waiting for a load watch it.
    changed: watch::Sender<u64>,
    /// Engine processes started, and loads failed or engines died (`/metrics`).
    starts: AtomicU64,
    failures: AtomicU64,
}

impl std::fmt::Debug for Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model").field("name", &self.name).finish()
    }
}

impl Model {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The model's status now.
    pub fn status(&self) -> Status {
        self.lock().status.clone()
    }

    /// Engine processes started, and failures (loads that failed, engines that died).
    pub fn counts(&self) -> (u64, u64) {
        (
            self.starts.load(Ordering::Relaxed),
            self.failures.load(Ordering::Relaxed),
        )
    }

    fn notify(&self) {
        self.changed.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// The memory the model will take once loaded, estimated from its header and settings;
    /// the file's size when the header cannot be read (its load then fails anyway).
    fn estimate_memory(&self) -> estimate::Estimate {
        let (size, _) = self.file_facts();
        // Unsized: all of it counted, none of it taken off for a GPU.
        let whole = estimate::Estimate {
            total: size,
            weights: size,
            kv: 0,
            host_weights: size,
            compute: 0,
        };
        let Ok(config) = serde_json::from_value::<RunnerConfig>(self.spec.config.clone()) else {
            return whole;
        };
        let Ok(shape) = estimate::read_shape(std::path::Path::new(&self.spec.path)) else {
            return whole;
        };
        let mut served = config.served();
        // A draft model is counted as a model of its own (its weights, its KV cache for every
        // slot, its compute buffers); one whose header cannot be sized, by its file.
        let draft = match config.draft_model.as_deref() {
            Some(path) => match estimate::draft(path, &served) {
                Ok(draft) => draft.total.saturating_sub(estimate::ENGINE_PROCESS),
                Err(_) => {
                    served.extra_files.push(path);
                    0
                }
            },
            None => 0,
        };
        let mut sized = estimate::breakdown(&shape, size, &served);
        sized.total = sized.total.saturating_add(draft);
        sized
    }

    /// The GGUF file's size and modification time (zero and the epoch when it cannot be read).
    /// How it is served (to serve it again).
    pub fn spec_of(&self) -> ModelSpec {
        self.spec.clone()
    }

    fn file_facts(&self) -> (u64, SystemTime) {
        std::fs::metadata(&self.spec.path)
            .map(|m| (m.len(), m.modified().unwrap_or(SystemTime::UNIX_EPOCH)))
            .unwrap_or((0, SystemTime::UNIX_EPOCH))
    }
}

/// A running request's hold on its model: while any is held the model is not unloaded to make
/// room or for idleness. Dropping it (when the response's body ends) starts the idle clock.
#[derive(Debug)]
pub struct Lease {
    model: Arc<Model>,
    registry: Arc<Registry>,
    /// The engine process's port.
    pub port: u16,
    /// The engine process it runs on: a lease of an engine since replaced unloads nothing.
    generation: u64,
    keep_alive: Option<Option<Duration>>,
    /// Ends without applying a keep-alive of 0 (`POST /models/load`'s lease).
    quiet: bool,
}

impl Lease {
    /// The request's `keep_alive`: how long its model stays loaded once idle (Some(None): for
    /// ever), replacing the model's until another request sets it.
    pub fn keep_alive(&mut self, keep_alive: Option<Duration>) {
        self.keep_alive = Some(keep_alive);
    }

    /// Ends the lease without unloading for a keep-alive of 0 (a load that serves nothing).
    pub fn release_quietly(mut self) {
        self.quiet = true;
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        let unload_now = {
            let mut inner = self.model.lock();
            inner.in_flight = inner.in_flight.saturating_sub(1);
            inner.last_used = Instant::now();
            if let Some(k) = self.keep_alive {
                inner.keep_alive = k;
            }
            !self.quiet && inner.in_flight == 0 && inner.keep_alive == Some(Duration::ZERO)
        };
        if unload_now {
            let generation = self.generation;
            self.registry
                .unload_when(&self.model, "keep_alive 0", |inner| {
                    inner.generation == generation
                        && inner.in_flight == 0
                        && inner.keep_alive == Some(Duration::ZERO)
                });
        }
    }
}

/// The router's models.
pub struct Registry {
    /// In listing order; a pulled model (`router/pull.rs`) joins at the end.
    models: std::sync::RwLock<Vec<Arc<Model>>>,
    /// Each model's keep-alive to start with (`--keep-alive`).
    keep_alive: Option<Duration>,
    /// How models are pulled (`--allow-pull`); unset: they are not.
    pull: std::sync::OnceLock<super::pull::PullConfig>,
    /// Other names of models: the name a pull was asked for (Hugging Face's with its `hf.co`
    /// prefix, say) when the model is served under another, or was already.
    aliases: std::sync::RwLock<std::collections::HashMap<String, String>>,
    /// The pulls running (`router/pull.rs`), by the name asked: their last progress line.
    pulling: Mutex<std::collections::BTreeMap<String, Value>>,
    max: usize,
    /// The most memory the loaded models' estimates may add up to (`--models-memory`); 0:
    /// no budget.
    memory_budget: u64,
    command: Vec<String>,
    /// The key the engines require and the router sends: nothing else on the machine can use
    /// an engine's port.
    key: String,
    /// How long a request waits for its model to load.
    load_timeout: Duration,
    /// One load decision (what to unload, what to start) at a time.
    loading: tokio::sync::Mutex<()>,
    /// One engine loading at a time, from its start until it is ready or gone: each engine's
    /// fit before load (`backend/llama/placement.rs`) then reads the GPUs' free memory with
    /// every other model's already taken, so that two loads never count the same memory.
    starting: Arc<tokio::sync::Mutex<()>>,
    started: AtomicU64,
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registry")
            .field("models", &self.models())
            .field("max", &self.max)
            .finish()
    }
}

fn model_of(spec: &ModelSpec, keep_alive: Option<Duration>) -> Arc<Model> {
    Arc::new(Model {
        name: spec.name.clone(),
        spec: spec.clone(),
        inner: Mutex::new(Inner {
            status: Status::Unloaded,
            process: None,
            generation: 0,
            in_flight: 0,
            last_used: Instant::now(),
            keep_alive,
            estimate: None,
            breakdown: None,
            vram_bytes: 0,
        }),
        changed: watch::channel(0).0,
        starts: AtomicU64::new(0),
        failures: AtomicU64::new(0),
    })
}

impl Registry {
    /// The registry of `specs`, at most `max` loaded at once whose estimates add up to at
    /// most `memory_budget` bytes (0: any), each kept `keep_alive` once idle (None: for
    /// ever); engines are started with `command`.
    pub fn new(
        specs: &[ModelSpec],
        max: usize,
        memory_budget: u64,
        keep_alive: Option<Duration>,
        command: Vec<String>,
        load_timeout: Duration,
    ) -> Arc<Self> {
        let models = specs
            .iter()
            .map(|spec| model_of(spec, keep_alive))
            .collect();
        Arc::new(Self {
            models: std::sync::RwLock::new(models),
            keep_alive,
            pull: std::sync::OnceLock::new(),
            aliases: std::sync::RwLock::default(),
            pulling: Mutex::default(),
            max: max.max(1),
            memory_budget,
            command,
            key: uuid::Uuid::new_v4().simple().to_string(),
            load_timeout,
            loading: tokio::sync::Mutex::new(()),
            starting: Arc::new(tokio::sync::Mutex::new(())),
            started: AtomicU64::new(0),
        })
    }

    /// Every model, in the order given (then those pulled since).
    pub fn models(&self) -> Vec<Arc<Model>> {
        self.models
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Adds the model of `spec` (one `router/pull.rs` fetched), unless one of its name or
    /// file is served already; returns the model served.
    pub fn add(&self, spec: &ModelSpec) -> Arc<Model> {
        let mut models = self.models.write().unwrap_or_else(|p| p.into_inner());
        if let Some(m) = models
            .iter()
            .find(|m| m.name == spec.name || m.spec.path == spec.path)
        {
            return m.clone();
        }
        let model = model_of(spec, self.keep_alive);
        models.push(model.clone());
        model
    }

    /// Makes `name` find `model` too (unless `name` is a model's own name).
    pub fn alias(&self, name: &str, model: &Arc<Model>) {
        if name != model.name {
            self.aliases
                .write()
                .unwrap_or_else(|p| p.into_inner())
                .insert(name.to_string(), model.name.clone());
        }
    }

    /// Notes a pull's progress line (`{"status", "completed", "total"}`); None: it ended.
    pub fn pull_progress(&self, name: &str, line: Option<&Value>) {
        let mut pulling = self.pulling.lock().unwrap_or_else(|p| p.into_inner());
        match line {
            Some(v) => {
                pulling.insert(name.to_string(), v.clone());
            }
            None => {
                pulling.remove(name);
            }
        }
    }

    /// The pulls running, for `GET /models`: each name with its last progress line.
    pub fn pulls(&self) -> Vec<(String, Value)> {
        let pulling = self.pulling.lock().unwrap_or_else(|p| p.into_inner());
        pulling
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    }

    /// Whether `name` is another name of a model (`alias`), not a model's own.
    pub fn is_alias(&self, name: &str) -> bool {
        self.aliases
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .contains_key(name)
    }

    /// Lets `POST /api/pull` fetch models with `config` (`--allow-pull`).
    pub fn allow_pull(&self, config: super::pull::PullConfig) {
        let _ = self.pull.set(config);
    }

    /// How models are pulled; None when they are not.
    pub fn pull_config(&self) -> Option<&super::pull::PullConfig> {
        self.pull.get()
    }

    /// The names, for error messages.
    pub fn names(&self) -> String {
        self.models()
            .iter()
            .map(|m| m.name.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// The key requests to the engines carry.
    pub fn engine_key(&self) -> &str {
        &self.key
    }

    /// The model a request names: its name, else the name with Ollama's `:latest` tag (or
    /// without it: `a` names a model served as `a:latest`), else its file name, each tried on every model before the next (a model named `a:latest` or
    /// `a.gguf` is found by its own name, not taken for `a`). Names are compared exactly, as
    /// the engine does. With no name, the only model when there is one.
    pub fn find(&self, requested: Option<&str>) -> Result<Arc<Model>, ApiError> {
        let requested = requested.filter(|r| !r.is_empty());
        let models = self.models();
        let Some(requested) = requested else {
            return match models.as_slice() {
                [only] => Ok(only.clone()),
                _ => Err(ApiError::invalid(format!(
                    "this server serves several models: name one in `model` ({})",
                    self.names()
                ))),
            };
        };
        let by_name = |name: &str| models.iter().find(|m| m.name == name);
        let by_file = || {
            models.iter().find(|m| {
                std::path::Path::new(&m.spec.path)
                    .file_name()
                    .is_some_and(|f| f.to_string_lossy() == requested)
            })
        };
        // A tagless name is Ollama's `name:latest` (a model of its store is served so).
        let tagged = (!requested.contains(':')).then(|| format!("{requested}:latest"));
        let aliased = || {
            let aliases = self.aliases.read().unwrap_or_else(|p| p.into_inner());
            aliases.get(requested).and_then(|n| by_name(n))
        };
        by_name(requested)
            .or_else(|| requested.strip_suffix(":latest").and_then(by_name))
            .or_else(|| tagged.as_deref().and_then(by_name))
            .or_else(aliased)
            .or_else(by_file)
            .cloned()
            .ok_or_else(|| {
                ApiError::ModelNotFound(format!(
                    "model '{}' is not served here; the models are: {}",
                    requested.chars().take(200).collect::<String>(),
                    self.names()
                ))
            })
    }

    /// Waits up to `limit` for the engine of `lease`, which did not answer a request, to be
    /// seen gone: true once it is (its process ended without being asked: killed, crashed;
    /// or another request has started the model again since), so that a new lease starts or
    /// finds the new one; false when it is still listed as loaded, or was unloaded on purpose
    /// (a new lease must not load it back).
    pub async fn engine_died(&self, lease: &Lease, limit: Duration) -> bool {
        let mut changes = lease.model.changed.subscribe();
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            {
                let inner = lease.model.lock();
                let same_engine = inner.generation == lease.generation
                    && inner.status == Status::Loaded { port: lease.port };
                if !same_engine {
                    return inner.status != Status::Unloaded;
                }
            }
            match tokio::time::timeout_at(deadline, changes.changed()).await {
                Ok(Ok(())) => {}
                _ => return false,
            }
        }
    }

    /// A lease on `model` if it is loaded; None otherwise (nothing is loaded).
    pub fn lease_if_loaded(self: &Arc<Self>, model: &Arc<Model>) -> Option<Lease> {
        let mut inner = model.lock();
        let Status::Loaded { port } = inner.status else {
            return None;
        };
        inner.in_flight += 1;
        Some(Lease {
            model: model.clone(),
            registry: self.clone(),
            port,
            generation: inner.generation,
            keep_alive: None,
            quiet: true,
        })
    }

    /// A lease on `model`, loading it first if it is not loaded (once, however many requests
    /// ask), waiting at most the load timeout.
    pub async fn lease(self: &Arc<Self>, model: &Arc<Model>) -> Result<Lease, ApiError> {
        let deadline = Instant::now() + self.load_timeout;
        let mut changes = model.changed.subscribe();
        loop {
            // What to do, decided under the lock (not held across an await).
            let load_first = {
                let mut inner = model.lock();
                match &inner.status {
                    Status::Loaded { port } => {
                        let port = *port;
                        inner.in_flight += 1;
                        return Ok(Lease {
                            model: model.clone(),
                            registry: self.clone(),
                            port,
                            generation: inner.generation,
                            keep_alive: None,
                            quiet: false,
                        });
                    }
                    Status::Loading { .. } => false,
                    Status::Unloaded | Status::Failed { .. } => true,
                }
            };
            if load_first {
                let left = deadline.saturating_duration_since(Instant::now());
                match tokio::time::timeout(left, self.load(model)).await {
                    Ok(loaded) => loaded?,
                    Err(_) => {
                        return Err(ApiError::Timeout(format!(
                            "model '{}' could not start loading within {:.0} s (other models \
                             were loading)",
                            model.name,
                            self.load_timeout.as_secs_f64()
                        )))
                    }
                }
                // A load that failed at once (no such file) answers this request.
                if let Status::Failed { error } = model.status() {
                    return Err(ApiError::LoadFailed(error));
                }
                continue;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            match tokio::time::timeout(left, changes.changed()).await {
                Ok(Ok(())) => {
                    if let Status::Failed { error } = model.status() {
                        return Err(ApiError::LoadFailed(error));
                    }
                }
                Ok(Err(_)) => return Err(ApiError::Unavailable("the server is stopping".into())),
                Err(_) => {
                    return Err(ApiError::Timeout(format!(
                        "model '{}' did not load within {:.0} s",
                        model.name,
                        self.load_timeout.as_secs_f64()
                    )))
                }
            }
        }
    }

    /// Starts `model`'s engine unless it is loading or loaded, unloading the least recently
    /// used idle model first when `--models-max` are already loaded.
    pub async fn load(self: &Arc<Self>, model: &Arc<Model>) -> Result<(), ApiError> {
        // Sized before the lock: a slow header read delays this load only.
        let need = if self.memory_budget > 0 {
            let m = model.clone();
            Some(
                tokio::task::spawn_blocking(move || m.estimate_memory())
                    .await
                    .unwrap_or_default(),
            )
        } else {
            None
        };
        // Behind the engine that is loading, if any (the request's load timeout runs).
        let starting = self.starting.clone().lock_owned().await;
        let _one_at_a_time = self.loading.lock().await;
        if model.lock().status.occupies() {
            return Ok(());
        }
        let occupied = self
            .models()
            .iter()
            .filter(|m| m.lock().status.occupies())
            .count();
        if occupied >= self.max {
            match self.least_recently_used_idle(model) {
                Some(lru) if self.unload_idle(&lru, "--models-max: making room") => {}
                _ => {
                    return Err(ApiError::Overloaded(format!(
                        "all {} model places (--models-max) are busy loading or serving; \
                         retry when one is idle",
                        self.max
                    )))
                }
            }
        }
        if let Some(need) = need {
            self.make_room_for(model, need.total)?;
        }
        let generation = self.started.fetch_add(1, Ordering::Relaxed) + 1;
        let config = self.engine_config(model);
        let spawned = EngineProcess::spawn(&self.command, &config, &model.name);
        let mut inner = model.lock();
        inner.generation = generation;
        inner.last_used = Instant::now();
        inner.estimate = need.map(|n| n.total);
        inner.breakdown = need;
        match spawned {
            Ok((process, events)) => {
                model.starts.fetch_add(1, Ordering::Relaxed);
                tracing::info!(model = %model.name, port = process.port, "loading a model");
                inner.status = Status::Loading {
                    since: Instant::now(),
                    progress: 0.0,
                };
                inner.process = Some(process);
                drop(inner);
                let registry = self.clone();
                let followed = model.clone();
                tokio::spawn(async move {
                    registry
                        .follow(followed, generation, events, starting)
                        .await
                });
                // An engine that neither becomes ready nor exits within the load timeout (a
                // hung load) is stopped, so that it holds no place.
                let registry = self.clone();
                let watched = model.clone();
                tokio::spawn(async move {
                    tokio::time::sleep(registry.load_timeout).await;
                    registry.fail_if_still_loading(&watched, generation);
                });
            }
            Err(e) => {
                model.failures.fetch_add(1, Ordering::Relaxed);
                inner.status = Status::Failed { error: e };
                drop(inner);
            }
        }
        model.notify();
        Ok(())
    }

    /// The loaded model, other than `except`, that has been idle longest.
    fn least_recently_used_idle(&self, except: &Arc<Model>) -> Option<Arc<Model>> {
        self.models()
            .iter()
            .filter(|m| !Arc::ptr_eq(m, except))
            .filter_map(|m| {
                let inner = m.lock();
                (matches!(inner.status, Status::Loaded { .. }) && inner.in_flight == 0)
                    .then(|| (inner.last_used, m.clone()))
            })
            .min_by_key(|(used, _)| *used)
            .map(|(_, m)| m)
    }

    /// Unloads idle models, least recently used first, until `need` more bytes fit in
    /// `--models-memory` beside the models loading or loaded: 507 when `model` alone is
    /// larger than the budget, 503 when the models that hold it are busy.
    fn make_room_for(&self, model: &Arc<Model>, need: u64) -> Result<(), ApiError> {
        const MIB: u64 = 1 << 20;
        if need > self.memory_budget {
            return Err(ApiError::InsufficientMemory(format!(
                "model '{}' needs about {} MiB (weights, KV cache for its slots, compute \
                 buffers, prompt cache), more than --models-memory {} MiB; serve it with \
                 a smaller --ctx-size, --parallel or --cache-ram, or raise --models-memory",
                model.name,
                need.div_ceil(MIB),
                self.memory_budget / MIB
            )));
        }
        loop {
            let used: u64 = self
                .models()
                .iter()
                .filter(|m| !Arc::ptr_eq(m, model))
                .map(|m| {
                    let inner = m.lock();
                    if inner.status.occupies() {
                        inner.estimate.unwrap_or(0)
                    } else {
                        0
                    }
                })
                .sum();
            if used.saturating_add(need) <= self.memory_budget {
                return Ok(());
            }
            match self.least_recently_used_idle(model) {
                Some(lru) if self.unload_idle(&lru, "--models-memory: making room") => {}
                _ => {
                    return Err(ApiError::Unavailable(format!(
                        "model '{}' needs about {} MiB and the models loading or serving \
                         hold {} of --models-memory {} MiB; retry when one is idle",
                        model.name,
                        need.div_ceil(MIB),
                        used.div_ceil(MIB),
                        self.memory_budget / MIB
                    )))
                }
            }
        }
    }

    /// The engine's configuration: the model's, on loopback, with the router's key.
    fn engine_config(&self, model: &Model) -> Value {
        let mut config = model.spec.config.clone();
        if let Some(c) = config.as_object_mut() {
            c.insert("host".into(), json!("127.0.0.1"));
            c.insert("api_key".into(), json!([self.key]));
            c.remove("api_key_file");
            c.insert("alias".into(), json!(model.name));
        }
        config
    }

    /// Follows one engine process: loaded when its `/health` says ready, failed when it exits
    /// before being asked to.
    async fn follow(
        self: Arc<Self>,
        model: Arc<Model>,
        generation: u64,
        mut events: tokio::sync::mpsc::Receiver<super::engine_process::Event>,
        starting: tokio::sync::OwnedMutexGuard<()>,
    ) {
        use super::engine_process::Event;
        // Held until the engine is ready or gone (or this load is superseded: the return).
        let mut starting = Some(starting);
        while let Some(event) = events.recv().await {
            let ended = {
                let mut inner = model.lock();
                if inner.generation != generation {
                    return;
                }
                match event {
                    Event::Progress(p) => {
                        if let Status::Loading { progress, .. } = &mut inner.status {
                            *progress = p;
                        }
                        false
                    }
                    Event::Ready(port, devices) => {
                        starting.take();
                        inner.vram_bytes = devices.as_ref().map_or(0, |d| d.vram_bytes);
                        // What the model holds in host memory, now that its layers are placed.
                        if let (Some(parts), Some(devices)) = (inner.breakdown, &devices) {
                            inner.estimate = Some(parts.on_host(devices));
                        }
                        tracing::info!(
                            model = %model.name,
                            port,
                            vram_bytes = inner.vram_bytes,
                            host_estimate_bytes = inner.estimate,
                            "model loaded"
                        );
                        inner.status = Status::Loaded { port };
                        inner.last_used = Instant::now();
                        false
                    }
                    Event::Exited(Exit { asked, error }) => {
                        starting.take();
                        inner.process = None;
                        if asked {
                            inner.status = Status::Unloaded;
                        } else {
                            tracing::error!(model = %model.name, "{error}");
                            model.failures.fetch_add(1, Ordering::Relaxed);
                            inner.status = Status::Failed { error };
                        }
                        true
                    }
                }
            };
            model.notify();
            if ended {
                return;
            }
        }
    }

    /// Unloads `model` (its engine process is killed; requests still running on it end with
    /// an error).
    pub fn unload(&self, model: &Model, why: &str) {
        self.unload_when(model, why, |_| true);
    }

    /// Unloads `model` when it is loading or loaded and `allowed` holds, judged under the
    /// same lock that marks it unloaded: a request that takes a lease in between is never
    /// cut off by a decision made before it came. True when it was unloaded.
    fn unload_when(&self, model: &Model, why: &str, allowed: impl FnOnce(&Inner) -> bool) -> bool {
        let process = {
            let mut inner = model.lock();
            if !inner.status.occupies() || !allowed(&inner) {
                return false;
            }
            inner.status = Status::Unloaded;
            inner.generation = inner.generation.wrapping_add(1 << 32);
            inner.process.take()
        };
        tracing::info!(model = %model.name, "unloading a model ({why})");
        if let Some(p) = process {
            p.kill();
        }
        model.notify();
        true
    }

    /// Stops an engine still loading since `generation` began and marks the model failed.
    fn fail_if_still_loading(&self, model: &Model, generation: u64) {
        let process = {
            let mut inner = model.lock();
            if inner.generation != generation || !matches!(inner.status, Status::Loading { .. }) {
                return;
            }
            model.failures.fetch_add(1, Ordering::Relaxed);
            inner.status = Status::Failed {
                error: format!(
                    "the engine did not load the model within {:.0} s (--timeout) and was stopped",
                    self.load_timeout.as_secs_f64()
                ),
            };
            inner.generation = inner.generation.wrapping_add(1 << 32);
            inner.process.take()
        };
        tracing::error!(model = %model.name, "a load timed out; its engine was stopped");
        if let Some(p) = process {
            p.kill();
        }
        model.notify();
    }

    /// Unloads `model` if it is loaded and idle (no lease).
    fn unload_idle(&self, model: &Model, why: &str) -> bool {
        self.unload_when(model, why, |inner| {
            matches!(inner.status, Status::Loaded { .. }) && inner.in_flight == 0
        })
    }

    /// Unloads every model whose idle time passed its keep-alive.
    pub fn expire_idle(&self) {
        let now = Instant::now();
        for m in &self.models() {
            let expired = {
                let inner = m.lock();
                matches!(inner.status, Status::Loaded { .. })
                    && inner.in_flight == 0
                    && inner
                        .keep_alive
                        .is_some_and(|k| now.saturating_duration_since(inner.last_used) >= k)
            };
            if expired {
                self.unload_when(m, "idle past its keep_alive", |inner| {
                    inner.in_flight == 0
                        && inner
                            .keep_alive
                            .is_some_and(|k| now.saturating_duration_since(inner.last_used) >= k)
                });
            }
        }
    }

    /// Takes `model` out of the registry (its files are being deleted: `/api/delete`),
    /// unloading it first; false, and nothing done, while a request holds it.
    pub fn remove(&self, model: &Arc<Model>) -> bool {
        if model.lock().in_flight > 0 {
            return false;
        }
        self.unload_when(model, "deleted", |inner| inner.in_flight == 0);
        if model.lock().in_flight > 0 {
            return false;
        }
        self.models
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|m| !Arc::ptr_eq(m, model));
        self.aliases
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|_, name| *name != model.name);
        true
    }

    /// Unloads every model (the server is stopping).
    pub fn unload_all(&self) {
        for m in &self.models() {
            self.unload(m, "the server is stopping");
        }
    }
}

mod listing;
#[cfg(test)]
mod tests;
