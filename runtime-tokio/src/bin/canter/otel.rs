//! OpenTelemetry export of the program's tracing spans (feature `otel`): on when
//! `OTEL_EXPORTER_OTLP_ENDPOINT` or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` is set, over OTLP/HTTP
//! (protobuf) in batches from a thread of the exporter's own. The spans are the program's own:
//! one `canter.task` per task run (id, name, queue, attempt). `OTEL_SERVICE_NAME` names the
//! service (`canter` when unset); the exporter reads the rest of the standard variables.

use opentelemetry::trace::TracerProvider;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_opentelemetry::OpenTelemetryLayer;

/// What exports spans, to be shut down (flushed) before the program exits.
pub(crate) struct Export {
    provider: SdkTracerProvider,
}

/// Whether the environment asks for an export.
fn wanted() -> bool {
    ["OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"]
        .iter()
        .any(|name| std::env::var_os(name).is_some_and(|value| !value.is_empty()))
}

/// The tracing layer that hands spans to the exporter.
pub(crate) type SpanLayer<S> = OpenTelemetryLayer<S, opentelemetry_sdk::trace::Tracer>;

/// The layer that hands spans to the exporter, when the environment asks for one; `Err` with
/// why it cannot be built (an unreadable endpoint).
pub(crate) fn layer<S>() -> Result<Option<(SpanLayer<S>, Export)>, String>
where
    S: tracing::Subscriber + for<'span> tracing_subscriber::registry::LookupSpan<'span>,
{
    if !wanted() {
        return Ok(None);
    }
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .build()
        .map_err(|e| format!("the OTLP exporter cannot start: {e}"))?;
    let mut resource = Resource::builder();
    if std::env::var_os("OTEL_SERVICE_NAME").is_none_or(|name| name.is_empty()) {
        resource = resource.with_service_name("canter");
    }
    let provider = SdkTracerProvider::builder().with_batch_exporter(exporter).with_resource(resource.build()).build();
    let tracer = provider.tracer("canter");
    Ok(Some((tracing_opentelemetry::layer().with_tracer(tracer), Export { provider })))
}

impl Export {
    /// Sends what is buffered and stops the exporter (bounded by the exporter's timeouts).
    pub(crate) fn shutdown(self) {
        if let Err(error) = self.provider.shutdown() {
            crate::output::say_line(format_args!("canter: the spans could not all be exported: {error}"));
        }
    }
}
