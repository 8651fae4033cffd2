//! Debian's CrowdSec local API (LAPI), run by a test: the binaries `cargo xtask setup` extracts
//! from the package (not installed: its postinst needs CrowdSec's central API), with a config
//! of the test's own in a temp dir: no central API (`online_client` absent), sqlite in the temp
//! dir, listening on a free port of 127.0.0.1, the agent off (`crowdsec -no-cs`). `cscli`
//! adds the machine, the bouncer and the decisions. Stopped by its pid, and its directory
//! removed, on drop.

use std::{
    net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream},
    path::{Path, PathBuf},
    process::Command,
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};

use crate::service::{Service, run_ok};

/// Where `cargo xtask setup` extracts the package (xtask/src/setup.rs, `CROWDSEC_ROOT`).
pub const ROOT: &str = "/var/cache/limiter-tests/crowdsec/root";

pub fn binary(name: &str) -> PathBuf {
    Path::new(ROOT).join("usr/bin").join(name)
}

pub struct Lapi {
    server: Option<Service>,
    dir: tempfile::TempDir,
    addr: SocketAddr,
}

impl Lapi {
    /// Writes the config, registers a machine (for cscli) and starts the LAPI; returns once it
    /// takes connections.
    pub fn start() -> anyhow::Result<Self> {
        for b in ["crowdsec", "cscli"] {
            if !binary(b).is_file() {
                bail!("{} is missing: `cargo xtask setup` extracts Debian's crowdsec there", binary(b).display());
            }
        }
        let dir =
            tempfile::Builder::new().prefix("lmt-crowdsec-").tempdir().context("creating crowdsec's directory")?;
        let d = dir.path();
        for sub in ["cfg", "data", "hub"] {
            std::fs::create_dir_all(d.join(sub)).with_context(|| format!("creating {}", d.join(sub).display()))?;
        }
        // A free port: taken, then let go for the LAPI to bind (a small race, on loopback only).
        let addr = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .and_then(|l| l.local_addr())
            .context("finding a free port for the LAPI")?;
        let cfg = d.join("cfg");
        std::fs::write(cfg.join("simulation.yaml"), "simulation: false\n").context("writing simulation.yaml")?;
        std::fs::write(cfg.join("profiles.yaml"), PROFILES).context("writing profiles.yaml")?;
        let config = format!(
            "common:\n  daemonize: false\n  log_media: stdout\n  log_level: info\n  working_dir: .\nconfig_paths:\n  \
             config_dir: {d}/cfg/\n  data_dir: {d}/data/\n  simulation_path: {d}/cfg/simulation.yaml\n  hub_dir: \
             {d}/hub/\n  index_path: {d}/hub/.index.json\n  notification_dir: {d}/cfg/notifications/\n  plugin_dir: \
             {ROOT}/usr/lib/crowdsec/plugins/\ndb_config:\n  log_level: info\n  type: sqlite\n  db_path: \
             {d}/data/crowdsec.db\n  use_wal: false\napi:\n  client:\n    credentials_path: \
             {d}/cfg/local_api_credentials.yaml\n  server:\n    log_level: info\n    listen_uri: {addr}\n    \
             profiles_path: {d}/cfg/profiles.yaml\n    trusted_ips:\n      - 127.0.0.1\nprometheus:\n  enabled: \
             false\n",
            d = d.display()
        );
        std::fs::write(cfg.join("config.yaml"), config).context("writing config.yaml")?;
        let mut lapi = Self { server: None, dir, addr };
        let creds = lapi.dir.path().join("cfg/local_api_credentials.yaml");
        let creds = creds.to_str().context("a temp dir's path is UTF-8")?.to_owned();
        lapi.cscli(&["machines", "add", "--auto", "--force", "-f", &creds])?;
        lapi.resume()?;
        Ok(lapi)
    }

    /// The config file.
    pub fn config(&self) -> PathBuf {
        self.dir.path().join("cfg/config.yaml")
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// `cscli -c CONFIG ARGS...`: its stdout, or an error with everything it said.
    pub fn cscli(&self, args: &[&str]) -> anyhow::Result<String> {
        run_ok(Command::new(binary("cscli")).arg("-c").arg(self.config()).args(args))
    }

    /// Registers a bouncer and returns its API key (`cscli bouncers add NAME -o raw`).
    pub fn add_bouncer(&self, name: &str) -> anyhow::Result<String> {
        let out = self.cscli(&["bouncers", "add", name, "-o", "raw"])?;
        let key = out.lines().map(str::trim).rfind(|l| !l.is_empty()).unwrap_or_default().to_owned();
        if key.is_empty() || key.contains(' ') {
            bail!("`cscli bouncers add {name} -o raw` printed no key: {out:?}");
        }
        Ok(key)
    }

    /// Stops the LAPI (SIGTERM, by its pid); [`Lapi::resume`] starts it again on the same
    /// config, database and port.
    pub fn stop(&mut self) {
        if let Some(mut server) = self.server.take() {
            server.stop();
        }
    }

    /// Starts the LAPI; returns once it takes connections on its port.
    pub fn resume(&mut self) -> anyhow::Result<()> {
        let mut cmd = Command::new(binary("crowdsec"));
        cmd.arg("-c").arg(self.config()).arg("-no-cs").current_dir(self.dir.path());
        let mut server = Service::spawn("crowdsec LAPI", &mut cmd)?;
        let deadline = Instant::now() + Duration::from_secs(20);
        while TcpStream::connect_timeout(&self.addr, Duration::from_millis(200)).is_err() {
            if let Some(status) = server.exited() {
                bail!("the crowdsec LAPI exited ({status}) at start:\n{}", server.output());
            }
            if Instant::now() >= deadline {
                bail!("the crowdsec LAPI took no connection on {} within 20 s:\n{}", self.addr, server.output());
            }
            thread::sleep(Duration::from_millis(50));
        }
        self.server = Some(server);
        Ok(())
    }

    /// What the LAPI said (its log goes to stdout).
    pub fn output(&self) -> String {
        self.server.as_ref().map(Service::output).unwrap_or_default()
    }
}

/// The package's profile: alerts on an address become a ban of 4 h (decisions `cscli decisions
/// add` makes carry their own duration and skip it).
const PROFILES: &str = "name: default_ip_remediation\nfilters:\n - Alert.Remediation == true && Alert.GetScope() == \
                        \"Ip\"\ndecisions:\n - type: ban\n   duration: 4h\non_success: break\n";
