//! Real `redis-server` processes for the tests that need one: a single server on a free
//! loopback port in a temporary directory, a three-master cluster, and the client config the
//! Redis tests start from. Each process is killed on drop.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use sluice::limiter::RedisConfig;
use sluice::limiter::redis::{RedisAuth, RedisTls};

use super::free_port;

/// A `redis-server` on a free port, killed on drop.
pub struct RedisProcess {
    pub port: u16,
    child: Child,
    _dir: tempfile::TempDir,
}

impl RedisProcess {
    pub fn start() -> Self {
        Self::start_on(free_port())
    }

    pub fn start_on(port: u16) -> Self {
        Self::spawn(port, &[])
    }

    pub fn spawn(port: u16, extra: &[&str]) -> Self {
        Self::listening(port, &["--port", &port.to_string()], extra)
    }

    /// A `redis-server` told how to listen by `listen` (e.g. `--port 0 --tls-port P`), with
    /// `extra` arguments, once it accepts connections on `port`.
    pub fn listening(port: u16, listen: &[&str], extra: &[&str]) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let child = Command::new("redis-server")
            .args(listen)
            .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .args(extra)
            .arg("--dir")
            .arg(dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server must be installed (Debian package redis-server)");
        let deadline = Instant::now() + Duration::from_secs(5);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "redis-server did not start on port {port}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        Self {
            port,
            child,
            _dir: dir,
        }
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// What `redis-cli` prints for `args` against this server.
    pub fn cli(&self, args: &[&str]) -> String {
        let out = Command::new("redis-cli")
            .args(["-p", &self.port.to_string()])
            .args(args)
            .output()
            .expect("redis-cli");
        String::from_utf8(out.stdout).unwrap()
    }

    /// Stops the server as a hung host would (`SIGSTOP`): connections stay open, nothing is
    /// answered, until [`RedisProcess::resume`].
    pub fn pause(&self) {
        self.signal("-STOP");
    }

    /// Lets a paused server run again (`SIGCONT`).
    pub fn resume(&self) {
        self.signal("-CONT");
    }

    fn signal(&self, signal: &str) {
        let status = Command::new("kill")
            .args([signal, &self.child.id().to_string()])
            .status()
            .expect("kill");
        assert!(status.success(), "kill {signal} failed");
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for RedisProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Three cluster-mode `redis-server`s joined by `redis-cli --cluster create`, no replicas.
pub struct RedisCluster {
    pub nodes: Vec<RedisProcess>,
}

impl RedisCluster {
    pub fn start() -> Self {
        let nodes: Vec<RedisProcess> = (0..3)
            .map(|_| {
                RedisProcess::spawn(
                    free_port(),
                    &["--cluster-enabled", "yes", "--cluster-node-timeout", "2000"],
                )
            })
            .collect();
        let addrs: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        let out = Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(&addrs)
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .output()
            .expect("redis-cli must be installed (Debian package redis-tools)");
        assert!(
            out.status.success(),
            "cluster create failed: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        let deadline = Instant::now() + Duration::from_secs(10);
        for n in &nodes {
            loop {
                let info = Command::new("redis-cli")
                    .args(["-p", &n.port.to_string(), "cluster", "info"])
                    .output()
                    .unwrap();
                if String::from_utf8_lossy(&info.stdout).contains("cluster_state:ok") {
                    break;
                }
                assert!(Instant::now() < deadline, "cluster never became ok");
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        Self { nodes }
    }

    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(RedisProcess::url).collect()
    }
}

/// A one-node config for `url` with short test timeouts; tests override fields.
pub fn config(url: &str) -> RedisConfig {
    RedisConfig {
        urls: vec![url.to_string()],
        cluster: false,
        key_prefix: "sluice-test:".into(),
        timeout: Duration::from_millis(200),
        connect_timeout: Duration::from_millis(200),
        breaker_failures: 3,
        breaker_cooldown: Duration::from_millis(200),
        deny_cache_keys: 0,
        sentinel: None,
        tls: RedisTls::default(),
        auth: RedisAuth::default(),
    }
}
