//! Connections over TLS, with TCP_NODELAY: every connection `canter_tokio::connect` opens has
//! the option set on its socket (sqlx 0.9.0 leaves it off, and over TLS a message longer than
//! one record then waits ~40 ms for the server's delayed ACK). Uses TLS when the server
//! offers it (`ssl = on`); a server without it is tested over plain TCP, which the option
//! concerns just the same.

#[path = "../../tests/common/pg.rs"]
mod pg;

use std::sync::Arc;
use std::time::Duration;

use canter::driver::TaskHandle;
use canter::postgres::tcp_nodelay;
use canter_tokio::{AppConfig, Client, TokioRuntime};
use sqlx::postgres::PgListener;
use sqlx::{Connection, PgConnection};

/// Whether the session behind `executor` uses TLS, and its socket's local port.
async fn session<'e>(executor: impl sqlx::PgExecutor<'e>) -> (bool, u16) {
    let (ssl, port): (Option<bool>, i32) =
        sqlx::query_as("SELECT (SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()), inet_client_port()")
            .fetch_one(executor)
            .await
            .expect("session facts");
    (ssl.unwrap_or(false), u16::try_from(port).expect("a TCP port"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_connection_canter_opens_has_tcp_nodelay_over_tls() {
    let db = pg::TestDb::new().await;
    let mut probe = PgConnection::connect(&db.url).await.expect("connect");
    let ssl: String = sqlx::query_scalar("SHOW ssl").fetch_one(&mut probe).await.expect("SHOW ssl");
    probe.close().await.expect("close");
    let tls = ssl == "on";
    let sep = if db.url.contains('?') { '&' } else { '?' };
    let url = if tls { format!("{}{sep}sslmode=require", db.url) } else { db.url.clone() };
    if !tls {
        eprintln!("the server does not offer TLS: testing TCP_NODELAY over plain TCP");
    }

    let pool = canter_tokio::connect(&url, 4).expect("pool");
    // Several connections of the pool at once, each a socket of its own.
    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(pool.acquire().await.expect("acquire"));
    }
    for connection in &mut held {
        let (ssl, port) = session(&mut **connection).await;
        assert_eq!(ssl, tls, "TLS in use as the server offers it");
        assert_eq!(tcp_nodelay(port), Some(true), "pool connection on local port {port}");
    }
    drop(held);
    // The listener's connection, and the client's writes (its kept connections).
    let mut listener = PgListener::connect_with(&pool).await.expect("listener");
    let (_, port) = session(&mut listener).await;
    assert_eq!(tcp_nodelay(port), Some(true), "listener on local port {port}");
    let client = Client::new(Arc::new(TokioRuntime), pool.clone(), db.schema.clone(), AppConfig::default());
    let echo: TaskHandle<serde_json::Value, serde_json::Value> = TaskHandle::named("echo");
    let payload = serde_json::json!({"text": "x".repeat(200)});
    let ids =
        client.enqueue_many(&echo, (0..1_000).map(|_| payload.clone())).await.expect("a bulk enqueue of 1,000 tasks");
    assert_eq!(ids.len(), 1_000);
    let (sockets, with_option) = pool_sockets(&pool).await;
    assert!(sockets >= 1 && with_option == sockets, "{with_option} of {sockets} pool sockets have TCP_NODELAY");

    // A connection made without canter's pool options does not: the check can tell.
    let mut plain = PgConnection::connect(&url).await.expect("connect");
    let (_, port) = session(&mut plain).await;
    assert_eq!(tcp_nodelay(port), Some(false), "sqlx's own connection, untouched");
    plain.close().await.expect("close");
    drop((listener, client));
    tokio::time::timeout(Duration::from_secs(5), pool.close()).await.expect("pool closes");
}

/// The pool's idle connections: how many, and how many have TCP_NODELAY.
async fn pool_sockets(pool: &sqlx::PgPool) -> (usize, usize) {
    let mut held = Vec::new();
    while let Some(connection) = pool.try_acquire() {
        held.push(connection);
    }
    let mut with_option = 0;
    for connection in &mut held {
        let (_, port) = session(&mut **connection).await;
        with_option += usize::from(tcp_nodelay(port) == Some(true));
    }
    (held.len(), with_option)
}
