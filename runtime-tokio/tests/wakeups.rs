//! The wake-up providers against the machine's RabbitMQ and NATS: a subscription hears what is
//! published, reports its connection lost when it is cut (through a proxy this test controls)
//! and comes back by itself; a broker that cannot be reached costs dropped wake-ups, counted,
//! and nothing else; a message that is no wake-up is left out alone.

#[path = "../../tests/common/brokers.rs"]
mod brokers;

use std::sync::Arc;
use std::time::Duration;

use canter_tokio::canter::driver::wakeups::{NatsWakeups, RabbitMqWakeups, WakeupProvider};
use canter_tokio::canter::task::TaskId;
use canter_tokio::canter::wake::Wakeup;
use canter_tokio::canter::worker::Input;
use futures::StreamExt;
use futures::stream::BoxStream;
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

/// A TCP proxy to `upstream` on a port of its own, whose connections can be cut.
struct Proxy {
    port: u16,
    upstream: String,
    accepting: Option<JoinHandle<()>>,
    connections: Arc<std::sync::Mutex<Vec<JoinHandle<()>>>>,
}

impl Proxy {
    async fn start(upstream: &str) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let mut proxy = Proxy { port, upstream: upstream.to_owned(), accepting: None, connections: Default::default() };
        proxy.accept(listener);
        proxy
    }

    fn accept(&mut self, listener: TcpListener) {
        let (upstream, connections) = (self.upstream.clone(), self.connections.clone());
        self.accepting = Some(tokio::spawn(async move {
            while let Ok((mut client, _)) = listener.accept().await {
                let upstream = upstream.clone();
                let copy = tokio::spawn(async move {
                    if let Ok(mut server) = TcpStream::connect(&upstream).await {
                        let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                    }
                });
                connections.lock().unwrap().push(copy);
            }
        }));
    }

    /// Closes every connection and refuses new ones.
    fn cut(&mut self) {
        if let Some(accepting) = self.accepting.take() {
            accepting.abort();
        }
        for connection in self.connections.lock().unwrap().drain(..) {
            connection.abort();
        }
    }

    /// Accepts connections again, on the same port (once the aborted listener is gone).
    async fn restore(&mut self) {
        for _ in 0..200 {
            let socket = tokio::net::TcpSocket::new_v4().unwrap();
            socket.set_reuseaddr(true).unwrap();
            if socket.bind(([127, 0, 0, 1], self.port).into()).is_ok() {
                self.accept(socket.listen(64).unwrap());
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("port {} stayed taken", self.port);
    }
}

async fn next(heard: &mut BoxStream<'static, Input>) -> Input {
    tokio::time::timeout(Duration::from_secs(30), heard.next())
        .await
        .expect("the subscription said nothing within 30 s")
        .expect("the subscription ended")
}

fn wakeup(id: i64) -> Wakeup {
    Wakeup { queue: "q \"1\".*".into(), priority: Some(-2), tasks: vec![TaskId(id)] }
}

/// Publishes until the subscription hears a wake-up (a publisher that has not noticed the cut
/// yet loses what it sends into the dead connection).
async fn heard_after_publishing(provider: &dyn WakeupProvider, heard: &mut BoxStream<'static, Input>) {
    for id in 0..100 {
        provider.publish(vec![wakeup(id)]);
        if let Ok(Some(input)) = tokio::time::timeout(Duration::from_millis(300), heard.next()).await {
            assert_eq!(input, Input::Notified { queue: "q \"1\".*".into(), priority: Some(-2), run_at: None });
            return;
        }
    }
    panic!("no wake-up heard after 100 tries");
}

async fn a_cut_subscription_comes_back(provider: impl Fn(&str) -> Arc<dyn WakeupProvider>, upstream: &str) {
    let mut proxy = Proxy::start(upstream).await;
    let provider = provider(&format!("127.0.0.1:{}", proxy.port));
    let mut heard = provider.subscribe(vec!["q \"1\".*".into(), "other".into()]);
    assert_eq!(next(&mut heard).await, Input::Listener { connected: true });
    heard_after_publishing(&*provider, &mut heard).await;

    proxy.cut();
    assert_eq!(next(&mut heard).await, Input::Listener { connected: false });
    proxy.restore().await;
    // Back by itself; what was published meanwhile is gone, which the worker's catch-up claim
    // on `connected: true` makes up for.
    loop {
        match next(&mut heard).await {
            Input::Listener { connected: true } => break,
            Input::Listener { connected: false } => {}
            other => panic!("heard {other:?} while cut"),
        }
    }
    heard_after_publishing(&*provider, &mut heard).await;
    // A publish is counted once the broker confirmed it, which can come after the subscriber
    // heard it: a flush waits for the publishes before it.
    tokio::time::timeout(Duration::from_secs(10), provider.flush()).await.expect("the outbox empties");
    let stats = provider.stats();
    assert!(stats.published >= 2 && stats.heard >= 2 && stats.malformed == 0, "{stats:?}");
}

/// The broker's `host:port`, from its URL.
fn rabbitmq_address() -> String {
    let url = brokers::rabbitmq_url();
    url.rsplit('@').next().unwrap().split('/').next().unwrap().to_owned()
}

fn nats_address() -> String {
    brokers::nats_url().trim_start_matches("nats://").to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_rabbitmq_subscription_comes_back() {
    let schema = format!("wakeups_cut_{}", std::process::id());
    a_cut_subscription_comes_back(
        |at| Arc::new(RabbitMqWakeups::new(&format!("amqp://guest:guest@{at}/%2f"), &schema).unwrap()),
        &rabbitmq_address(),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_nats_subscription_comes_back() {
    let schema = format!("wakeups_cut_{}", std::process::id());
    a_cut_subscription_comes_back(
        |at| Arc::new(NatsWakeups::new(&format!("nats://{at}"), &schema).unwrap()),
        &nats_address(),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_broker_drops_what_is_published_and_hears_nothing() {
    // Nothing listens on port 1.
    let providers: [Arc<dyn WakeupProvider>; 2] = [
        Arc::new(RabbitMqWakeups::new("amqp://guest:guest@127.0.0.1:1/%2f", "unreachable").unwrap()),
        Arc::new(NatsWakeups::new("nats://127.0.0.1:1", "unreachable").unwrap()),
    ];
    for provider in providers {
        let mut heard = provider.subscribe(vec!["default".into()]);
        provider.publish(vec![wakeup(1), wakeup(2)]);
        tokio::time::timeout(Duration::from_secs(10), provider.flush()).await.expect("the outbox empties");
        assert_eq!(provider.stats().dropped, 2, "{}", provider.name());
        assert!(tokio::time::timeout(Duration::from_millis(500), heard.next()).await.is_err(), "nothing heard");
    }
    // Addresses they do not understand are refused at once.
    assert!(RabbitMqWakeups::new("http://x", "s").is_err());
    assert!(NatsWakeups::new("nats://a b:x", "s").is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_that_is_no_wakeup_is_left_out_alone() {
    let schema = format!("wakeups_poison_{}", std::process::id());
    let provider = NatsWakeups::new(&brokers::nats_url(), &schema).unwrap();
    let mut heard = provider.subscribe(vec!["default".into()]);
    assert_eq!(next(&mut heard).await, Input::Listener { connected: true });
    // Another publisher writes garbage on the queue's subject, then a wake-up.
    let raw = async_nats::connect(brokers::nats_url()).await.unwrap();
    let subject = format!("canter.{schema}.{}", canter_tokio::canter::wake::queue_token("default"));
    raw.publish(subject.clone(), "\0not json".into()).await.unwrap();
    raw.publish(subject, Wakeup { queue: "default".into(), priority: None, tasks: vec![] }.encode().into())
        .await
        .unwrap();
    raw.flush().await.unwrap();
    assert_eq!(next(&mut heard).await, Input::Notified { queue: "default".into(), priority: None, run_at: None });
    assert_eq!(provider.stats().malformed, 1);
}

/// After `flush`, what was published has reached the broker: a provider dropped right after
/// (a `canter enqueue` exiting) loses none of it.
async fn flushed_wakeups_outlive_their_provider(make: impl Fn() -> Arc<dyn WakeupProvider>) {
    let listening = make();
    let mut heard = listening.subscribe(vec!["q \"1\".*".into()]);
    assert_eq!(next(&mut heard).await, Input::Listener { connected: true });
    let publishing = make();
    // Connected first, as a command that enqueued would be.
    publishing.publish(vec![wakeup(0)]);
    publishing.flush().await;
    assert!(matches!(next(&mut heard).await, Input::Notified { .. }));
    for id in 1..=200 {
        publishing.publish(vec![wakeup(id)]);
    }
    publishing.flush().await;
    drop(publishing);
    for n in 1..=200 {
        let input = tokio::time::timeout(Duration::from_secs(5), heard.next()).await;
        assert!(matches!(input, Ok(Some(Input::Notified { .. }))), "wake-up {n} of 200 was lost: {input:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flushed_wakeups_reach_rabbitmq_before_the_provider_goes() {
    let schema = format!("wakeups_flush_{}", std::process::id());
    let url = brokers::rabbitmq_url();
    flushed_wakeups_outlive_their_provider(|| Arc::new(RabbitMqWakeups::new(&url, &schema).unwrap())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flushed_wakeups_reach_nats_before_the_provider_goes() {
    let schema = format!("wakeups_flush_{}", std::process::id());
    let url = brokers::nats_url();
    flushed_wakeups_outlive_their_provider(|| Arc::new(NatsWakeups::new(&url, &schema).unwrap())).await;
}
