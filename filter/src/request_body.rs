//! Request body inspection (placeholder API; the real parser replaces this).

#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RequestInfo {
    pub model: Option<String>,
    pub stream: bool,
    pub max_tokens: Option<u64>,
    pub include_usage: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BodyError {
    NotJson(String),
    NotAnObject,
    BadField { field: &'static str, message: String },
}

impl std::fmt::Display for BodyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BodyError::NotJson(e) => write!(f, "request body is not valid JSON: {e}"),
            BodyError::NotAnObject => f.write_str("request body must be a JSON object"),
            BodyError::BadField { field, message } => write!(f, "{field}: {message}"),
        }
    }
}

pub fn inspect(_body: &[u8]) -> Result<RequestInfo, BodyError> {
    Err(BodyError::NotAnObject)
}

pub fn with_include_usage(body: &[u8]) -> Result<Vec<u8>, BodyError> {
    Ok(body.to_vec())
}
