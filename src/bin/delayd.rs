//! The delayd server: configuration, logging, the broker, and the HTTP API with a graceful stop.

use std::io::IsTerminal;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use delayd::config::cli::Cli;
use delayd::config::{Config, LogFormat};
use delayd::{router, serve as serve_http, AppState, Broker, Limits, ServeConfig};
use tokio::sync::Notify;
use tracing_subscriber::EnvFilter;

/// The server's allocator (see Cargo.toml for why not the system's).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let (cfg, ignored_env) = match Config::load_noting(&cli, std::env::vars_os()) {
        Ok(loaded) => loaded,
        Err(e) => {
            eprintln!("delayd: {e}");
            return ExitCode::from(2);
        }
    };
    init_logging(&cfg);
    for warning in ignored_env {
        tracing::warn!("{warning}");
    }
    // At least two workers, even on one CPU (or pinned to one): a lone sync request fdatasyncs on
    // the worker that parsed it, and another worker must go on reading requests meanwhile, so
    // they queue for the engine thread's group commit instead of waiting one fdatasync each.
    let workers = std::thread::available_parallelism().map_or(2, |n| n.get().max(2));
    let built = tokio::runtime::Builder::new_multi_thread().worker_threads(workers).enable_all().build();
    let runtime = match built {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("delayd: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let json_logs = cfg.log_format == LogFormat::Json;
    match runtime.block_on(run(cfg)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // One line either way: JSON for log collectors, plain text for a person at a terminal.
            if json_logs {
                tracing::error!("{e}");
            } else {
                eprintln!("delayd: {e}");
            }
            ExitCode::FAILURE
        }
    }
}

fn init_logging(cfg: &Config) {
    // `validate` already checked the filter; the fallback only guards against a future mismatch.
    let filter = EnvFilter::try_new(&cfg.log_level).unwrap_or_else(|_| EnvFilter::new("info"));
    // Colour codes only for a person at a terminal (who did not ask for none with NO_COLOR):
    // under systemd, stderr goes to the journal, which would store the escape codes.
    let colour = std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    let builder =
        tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_ansi(colour);
    match cfg.log_format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

/// Errors of the program are reported as one sentence on stderr.
type Result<T> = std::result::Result<T, String>;

async fn run(cfg: Config) -> Result<()> {
    // The port first: a busy port fails the start at once, before recovery runs and before the
    // data directory is created. Connections that arrive during recovery wait in the backlog.
    let addr = cfg.listen_addr().map_err(|e| e.to_string())?;
    // Said before binding, so it is in the log even when the bind then fails.
    if cfg.auth_token.is_none() && !addr.ip().is_loopback() {
        tracing::warn!(
            listen = %addr,
            "listening beyond loopback without auth_token: anyone who reaches {addr} can read, \
             produce, purge and change every topic; set auth_token (and read_token for readers)"
        );
    }
    let listener =
        tokio::net::TcpListener::bind(addr).await.map_err(|e| format!("cannot listen on {addr}: {e}"))?;
    let local = listener.local_addr().map_err(|e| format!("cannot read the bound address: {e}"))?;
    let serve_cfg = serve_config(&cfg);
    let dir = cfg.data_dir.display();
    let cluster_cfg = delayd::cluster::ClusterConfig::from_config(&cfg, local).map_err(|e| e.to_string())?;
    let (broker, cluster) = match &cluster_cfg {
        None if cfg.data_dir.join("cluster").join("raft_state").exists() => {
            return Err(format!(
                "{dir} belongs to a cluster node (it holds cluster/raft_state): start it with its cluster \
                 settings (node_id, peers, ...); as a single node it would write records the cluster would cut"
            ));
        }
        None => (
            Broker::open(cfg.broker_config())
                .map_err(|e| format!("cannot open data directory {dir}: {e}"))?,
            None,
        ),
        Some(cc) => {
            let rt = tokio::runtime::Handle::current();
            let (broker, state) = delayd::cluster::open_broker(&cfg, cc, &rt, local)
                .map_err(|e| format!("cannot start cluster node {} on {dir}: {e}", cc.node_id))?;
            (broker, Some(state))
        }
    };
    // Tests and scripts read this line to learn the port when `listen` asks for port 0.
    println!("delayd listening on http://{local}");
    tracing::info!(%local, data_dir = %cfg.data_dir.display(), flush = ?cfg.flush, "delayd started");
    notify_systemd(&[sd_notify::NotifyState::Ready]);
    // Push delivery runs beside the server and stops with it (a delivery cut short comes back
    // when its reservation runs out).
    let pusher = tokio::spawn(delayd::run_push(broker.clone()));
    let served = serve(&cfg, serve_cfg, listener, broker.clone(), cluster).await;
    pusher.abort();
    let stopped = broker.shutdown().await.map_err(|e| format!("broker shutdown failed: {e}"));
    served?;
    stopped?;
    tracing::info!("stopped cleanly");
    Ok(())
}

/// Tells systemd (`Type=notify`) about a change of state; nothing happens when it did not start us.
fn notify_systemd(state: &[sd_notify::NotifyState]) {
    if let Err(e) = sd_notify::notify(state) {
        tracing::warn!("cannot notify systemd ($NOTIFY_SOCKET): {e}");
    }
}

/// Raises the soft limit on open files to the hard one and fits the connection cap to it, saying
/// what it found and did.
fn serve_config(cfg: &Config) -> ServeConfig {
    let mut serve_cfg = ServeConfig::from_config(cfg);
    let show = |v: Option<u64>| v.map_or("unlimited".to_string(), |n| n.to_string());
    let limit = match delayd::http::raise_file_limit() {
        Ok((before, after)) => {
            tracing::info!(
                soft = %show(after.soft),
                hard = %show(after.hard),
                soft_at_start = %show(before.soft),
                "open file limit (RLIMIT_NOFILE)"
            );
            after
        }
        Err(e) => match delayd::http::file_limit() {
            Ok(now) => {
                tracing::warn!(soft = %show(now.soft), hard = %show(now.hard), "cannot raise the open file limit: {e}");
                now
            }
            Err(e) => {
                tracing::warn!("cannot read the open file limit: {e}; max_connections is not fitted to it");
                return serve_cfg;
            }
        },
    };
    if let Some(cap) = serve_cfg.fit_to_file_handles(limit.soft_or_max(), cfg.open_queues) {
        tracing::warn!(
            max_connections = cfg.max_connections,
            lowered_to = cap,
            open_files = %show(limit.soft),
            "max_connections lowered to fit the open file limit beside the store's files and push \
             deliveries; raise the limit (LimitNOFILE= under systemd, ulimit -n) to serve more"
        );
    }
    serve_cfg
}

async fn serve(
    cfg: &Config,
    serve_cfg: ServeConfig,
    listener: tokio::net::TcpListener,
    broker: Broker,
    cluster: Option<Arc<delayd::cluster::ClusterState>>,
) -> Result<()> {
    let state = match cluster {
        Some(c) => AppState::clustered(broker, Limits::from_config(cfg), c),
        None => AppState::new(broker, Limits::from_config(cfg)),
    };
    let signalled = Arc::new(Notify::new());
    let on_signal = {
        let state = state.clone();
        let signalled = signalled.clone();
        async move {
            wait_for_signal().await;
            tracing::info!("shutdown requested: no new connections, finishing in-flight requests");
            notify_systemd(&[sd_notify::NotifyState::Stopping]);
            state.begin_shutdown();
            signalled.notify_one();
        }
    };
    let mut server = tokio::spawn(serve_http(listener, router(state), serve_cfg, on_signal));
    tokio::select! {
        res = &mut server => return joined(res),
        _ = signalled.notified() => {}
    }
    let grace = Duration::from_millis(cfg.shutdown_grace);
    match tokio::time::timeout(grace, &mut server).await {
        Ok(res) => joined(res),
        Err(_) => {
            tracing::warn!(?grace, "in-flight requests still running after the grace period; closing them");
            server.abort();
            Ok(())
        }
    }
}

fn joined(res: std::result::Result<(), tokio::task::JoinError>) -> Result<()> {
    res.map_err(|e| format!("server task failed: {e}"))
}

async fn wait_for_signal() {
    let ctrl_c = async {
        if let Err(e) = tokio::signal::ctrl_c().await {
            tracing::error!("cannot listen for Ctrl-C: {e}");
            std::future::pending::<()>().await;
        }
    };
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(e) => {
                tracing::error!("cannot listen for SIGTERM: {e}");
                std::future::pending::<()>().await;
            }
        }
    };
    tokio::select! {
        _ = ctrl_c => {}
        _ = term => {}
    }
}
