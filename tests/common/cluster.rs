//! A PostgreSQL cluster of a test's own: created with Debian's cluster tools when running as
//! root (initdb refuses root; `pg_createcluster` runs it as the postgres user), or with
//! `initdb`/`pg_ctl` in a temporary directory otherwise. Tests may stop and start it.

#![allow(dead_code, unreachable_pub)]

use std::process::{Command, Stdio};

/// A PostgreSQL server of this test's own, which it may stop and start.
pub struct Cluster {
    /// Its URL (user postgres, trust auth).
    pub url: String,
    /// The command that stops it.
    pub stop: Vec<String>,
    /// The command that starts it.
    pub start: Vec<String>,
    cleanup: Vec<String>,
    /// Whether dropping it removes it.
    pub remove_on_drop: bool,
}

/// Runs a command quietly; whether it succeeded.
pub fn sh(command: &[String]) -> bool {
    Command::new(&command[0])
        .args(&command[1..])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Whether nothing listens on `port` of 127.0.0.1 now.
fn port_is_free(port: u16) -> bool {
    std::net::TcpListener::bind(("127.0.0.1", port)).is_ok()
}

impl Cluster {
    /// Creates (afresh) and starts a cluster called `name` on `port`, or on the next port
    /// after it that nothing listens on (a range of test ports can hold another service's,
    /// RabbitMQ's 5672 say); a cluster that does not start is tried once more on another.
    pub fn start(name: &str, port: u16) -> Cluster {
        let mut port = port;
        let mut failures = Vec::new();
        for _ in 0..3 {
            while !port_is_free(port) {
                port = port.wrapping_add(1).max(1024);
            }
            match Cluster::try_start(name, port) {
                Ok(cluster) => return cluster,
                Err(why) => failures.push(format!("port {port}: {why}")),
            }
            port = port.wrapping_add(1).max(1024);
        }
        panic!("the cluster did not start: {}", failures.join("; "))
    }

    fn try_start(name: &str, port: u16) -> Result<Cluster, String> {
        let is_root = Command::new("id").arg("-u").output().is_ok_and(|o| o.stdout.starts_with(b"0"));
        let strings = |parts: &[&str]| parts.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let cluster = if is_root {
            // As root, initdb refuses to run: Debian's cluster tools run it as postgres.
            let version = std::fs::read_dir("/usr/lib/postgresql")
                .expect("PostgreSQL is installed")
                .filter_map(|e| e.ok()?.file_name().into_string().ok())
                .max_by_key(|v| v.parse::<u32>().unwrap_or(0))
                .expect("a PostgreSQL version");
            let _ = sh(&strings(&["pg_dropcluster", "--stop", &version, name]));
            let created =
                sh(&strings(&["pg_createcluster", &version, name, "-p", &port.to_string(), "--", "--auth=trust"]));
            if !created {
                return Err("pg_createcluster failed".to_owned());
            }
            let ctl = |action: &str| strings(&["pg_ctlcluster", "--skip-systemctl-redirect", &version, name, action]);
            Cluster {
                url: format!("postgres://postgres@127.0.0.1:{port}/postgres"),
                stop: ctl("stop"),
                start: ctl("start"),
                cleanup: strings(&["pg_dropcluster", "--stop", &version, name]),
                remove_on_drop: true,
            }
        } else {
            let dir = std::env::temp_dir().join(format!("canter-{name}-{port}"));
            let _ = std::fs::remove_dir_all(&dir);
            let bin = std::fs::read_dir("/usr/lib/postgresql")
                .ok()
                .and_then(|d| {
                    d.filter_map(|e| e.ok()).map(|e| e.path().join("bin")).find(|p| p.join("initdb").exists())
                })
                .map(|p| p.display().to_string() + "/")
                .unwrap_or_default();
            let data = dir.display().to_string();
            if !sh(&strings(&[&format!("{bin}initdb"), "-D", &data, "-U", "postgres", "--auth=trust"])) {
                return Err("initdb failed".to_owned());
            }
            let pg_ctl = |action: &str| {
                strings(&[&format!("{bin}pg_ctl"), "-D", &data, "-w", "-o", &format!("-p {port} -k {data}"), action])
            };
            Cluster {
                url: format!("postgres://postgres@127.0.0.1:{port}/postgres"),
                stop: pg_ctl("stop"),
                start: pg_ctl("start"),
                cleanup: strings(&["rm", "-rf", &data]),
                remove_on_drop: true,
            }
        };
        let started = Command::new(&cluster.start[0]).args(&cluster.start[1..]).output();
        match started {
            Ok(out) if out.status.success() => Ok(cluster),
            Ok(out) => Err(format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout).trim(),
                String::from_utf8_lossy(&out.stderr).trim()
            )),
            Err(e) => Err(format!("{}: {e}", cluster.start[0])),
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if self.remove_on_drop {
            let _ = sh(&self.stop);
            let _ = sh(&self.cleanup);
        }
    }
}
