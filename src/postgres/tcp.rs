//! TCP_NODELAY on the connections to PostgreSQL, whatever sqlx does.
//!
//! sqlx 0.9.0 opens its TCP sockets without `TCP_NODELAY` (sqlx issue #4335; the fix, PR
//! #4336, is merged but not released). Nagle's algorithm then holds back the last segment of a
//! message larger than one segment until the server's delayed ACK comes, about 40 ms later:
//! over TLS every message longer than one TLS record pays it (a bulk enqueue, a batch of
//! results). sqlx offers no hook on its sockets, so [`set_tcp_nodelay`] finds them among the
//! process's open descriptors by their peer address after a connection is made (the pool's
//! `after_connect` hook, which [`pool_options`] installs) and sets the option. Remove this
//! module once a sqlx release sets the option itself.

use std::net::{IpAddr, SocketAddr};
use std::os::fd::{BorrowedFd, RawFd};

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

/// Pool options whose every new connection gets `TCP_NODELAY` ([`set_tcp_nodelay`] on the
/// host and port of `options`), for pools built by hand: `canter_tokio::connect` and
/// `canter_smol::connect` start from these. Set your own `after_connect` instead and it
/// replaces this one: call [`set_tcp_nodelay`] in it.
pub fn pool_options(options: &PgConnectOptions) -> PgPoolOptions {
    let host = options.get_host().to_owned();
    let port = options.get_port();
    PgPoolOptions::new().after_connect(move |_connection, _meta| {
        set_tcp_nodelay(&host, port);
        Box::pin(std::future::ready(Ok(())))
    })
}

/// Sets `TCP_NODELAY` on every TCP socket of this process connected to `port` of `host` (any
/// address, when `host` is a name rather than an IP address) that does not have it yet, and
/// returns how many it set. A Unix-domain `host` (a path) has no TCP sockets: 0.
///
/// Sockets of other libraries connected to the same server get the option too, which only
/// makes them faster. Descriptors that are not TCP sockets, or that close while they are
/// looked at, are passed by.
pub fn set_tcp_nodelay(host: &str, port: u16) -> usize {
    if host.starts_with('/') {
        return 0;
    }
    let ip: Option<IpAddr> = host.trim_matches(&['[', ']'][..]).parse().ok();
    let wanted = |peer: SocketAddr| peer.port() == port && ip.is_none_or(|ip| same_ip(ip, peer.ip()));
    let mut set = 0;
    for fd in open_descriptors() {
        // SAFETY: `fd` was open when listed. If it closes before the calls below, they fail
        // with EBADF; if its number is reused by then, the calls reach another descriptor of
        // this process: reading its peer address changes nothing, and the option is set only
        // on a TCP socket connected to the database's port, which is what this function does.
        #[allow(unsafe_code)]
        let borrowed = unsafe { BorrowedFd::borrow_raw(fd) };
        let socket = socket2::SockRef::from(&borrowed);
        let Ok(peer) = socket.peer_addr() else { continue };
        let Some(peer) = peer.as_socket() else { continue };
        if !wanted(peer) || !matches!(socket.r#type(), Ok(socket2::Type::STREAM)) {
            continue;
        }
        if socket.tcp_nodelay().is_ok_and(|on| !on) && socket.set_tcp_nodelay(true).is_ok() {
            set += 1;
        }
    }
    set
}

/// Whether the TCP socket of this process bound to `local_port` has `TCP_NODELAY` (`None`:
/// no such socket). With `SELECT inet_client_port()` on a connection, this tells whether that
/// connection has it: for tests and diagnostics.
pub fn tcp_nodelay(local_port: u16) -> Option<bool> {
    open_descriptors().into_iter().find_map(|fd| {
        // SAFETY: as in `set_tcp_nodelay`; nothing is changed here.
        #[allow(unsafe_code)]
        let borrowed = unsafe { BorrowedFd::borrow_raw(fd) };
        let socket = socket2::SockRef::from(&borrowed);
        let local = socket.local_addr().ok()?.as_socket()?;
        socket.peer_addr().ok()?;
        (local.port() == local_port).then(|| socket.tcp_nodelay().ok()).flatten()
    })
}

/// The same address, an IPv4 one also in its IPv6-mapped form.
fn same_ip(a: IpAddr, b: IpAddr) -> bool {
    a.to_canonical() == b.to_canonical()
}

/// This process's open descriptors (Linux `/proc/self/fd`, elsewhere `/dev/fd`).
fn open_descriptors() -> Vec<RawFd> {
    let listing = std::fs::read_dir("/proc/self/fd").or_else(|_| std::fs::read_dir("/dev/fd"));
    let Ok(listing) = listing else { return Vec::new() };
    listing.filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<RawFd>().ok()).filter(|&fd| fd >= 0).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_socket_to_the_port_gets_the_option_and_others_do_not() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let other = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let client = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        let bystander = std::net::TcpStream::connect(other.local_addr().unwrap()).unwrap();
        let local = |s: &std::net::TcpStream| s.local_addr().unwrap().port();
        assert_eq!(tcp_nodelay(local(&client)), Some(false));
        assert_eq!(set_tcp_nodelay("127.0.0.1", port), 1);
        assert!(client.nodelay().unwrap());
        assert_eq!(tcp_nodelay(local(&client)), Some(true));
        assert_eq!(tcp_nodelay(local(&bystander)), Some(false), "a socket to another port is left alone");
        assert_eq!(set_tcp_nodelay("127.0.0.1", port), 0, "set already");
        assert_eq!(set_tcp_nodelay("/var/run/postgresql", port), 0);
        // A host name matches any address on the port; another address does not.
        let again = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        assert_eq!(set_tcp_nodelay("10.1.2.3", port), 0);
        assert_eq!(set_tcp_nodelay("db.example", port), 1);
        assert!(again.nodelay().unwrap());
    }
}
