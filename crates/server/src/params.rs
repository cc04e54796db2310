//! Reading request fields out of a JSON object with a precise error per field: the error names
//! the parameter (`param`) and says what was wrong, as OpenAI's API does.

use serde_json::{Map, Value};

use crate::error::ApiError;

pub type Obj = Map<String, Value>;

/// The body as a JSON object.
pub fn object(body: &Value) -> Result<&Obj, ApiError> {
    body.as_object().ok_or_else(|| ApiError::bad_request("the body must be a JSON object"))
}

/// A field, treating `null` as absent.
pub fn field<'a>(o: &'a Obj, key: &str) -> Option<&'a Value> {
    o.get(key).filter(|v| !v.is_null())
}

pub fn opt_str<'a>(o: &'a Obj, key: &str) -> Result<Option<&'a str>, ApiError> {
    match field(o, key) {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(_) => Err(ApiError::invalid(key, format!("'{key}' must be a string"))),
    }
}

pub fn opt_bool(o: &Obj, key: &str) -> Result<Option<bool>, ApiError> {
    match field(o, key) {
        None => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(_) => Err(ApiError::invalid(key, format!("'{key}' must be true or false"))),
    }
}

/// A number in `[lo, hi]`.
pub fn opt_f64(o: &Obj, key: &str, lo: f64, hi: f64) -> Result<Option<f64>, ApiError> {
    match field(o, key) {
        None => Ok(None),
        Some(v) => match v.as_f64() {
            Some(x) if x.is_finite() && (lo..=hi).contains(&x) => Ok(Some(x)),
            _ => Err(ApiError::invalid(key, format!("'{key}' must be a number between {lo} and {hi}"))),
        },
    }
}

/// An integer in `[lo, hi]`.
pub fn opt_int(o: &Obj, key: &str, lo: i64, hi: i64) -> Result<Option<i64>, ApiError> {
    match field(o, key) {
        None => Ok(None),
        Some(v) => match v.as_i64() {
            Some(x) if (lo..=hi).contains(&x) => Ok(Some(x)),
            _ => Err(ApiError::invalid(key, format!("'{key}' must be an integer between {lo} and {hi}"))),
        },
    }
}

/// A seed: any integer that fits 64 bits (negative ones are taken as their bit pattern).
pub fn opt_seed(o: &Obj, key: &str) -> Result<Option<u64>, ApiError> {
    match field(o, key) {
        None => Ok(None),
        Some(v) => match (v.as_u64(), v.as_i64()) {
            (Some(x), _) => Ok(Some(x)),
            (None, Some(x)) => Ok(Some(x as u64)),
            _ => Err(ApiError::invalid(key, format!("'{key}' must be an integer"))),
        },
    }
}

/// `stop`: a string or a list of strings.
pub fn stop_list(o: &Obj, key: &str) -> Result<Vec<String>, ApiError> {
    const MAX_STOPS: usize = 16;
    let list = match field(o, key) {
        None => return Ok(Vec::new()),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => {
            let mut out = Vec::with_capacity(a.len());
            for v in a {
                match v {
                    Value::String(s) => out.push(s.clone()),
                    _ => return Err(ApiError::invalid(key, format!("'{key}' must be a string or a list of strings"))),
                }
            }
            out
        }
        Some(_) => return Err(ApiError::invalid(key, format!("'{key}' must be a string or a list of strings"))),
    };
    if list.len() > MAX_STOPS {
        return Err(ApiError::invalid(key, format!("at most {MAX_STOPS} stop sequences")));
    }
    if list.iter().any(|s| s.is_empty()) {
        return Err(ApiError::invalid(key, "stop sequences must not be empty"));
    }
    Ok(list)
}

/// Refuse fields this server does not implement rather than silently ignoring them, unless they
/// hold their neutral value.
pub fn unsupported(o: &Obj, key: &str, neutral: impl Fn(&Value) -> bool) -> Result<(), ApiError> {
    match field(o, key) {
        Some(v) if !neutral(v) => Err(ApiError::invalid(key, format!("'{key}' is not supported by this server"))),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn obj(v: Value) -> Obj {
        v.as_object().unwrap().clone()
    }

    #[test]
    fn fields_are_checked_with_their_names() {
        let o = obj(json!({"t": 5, "s": "x", "n": 1.5, "big": 1e30, "neg": -3, "stop": ["a", 1], "z": null}));
        assert_eq!(opt_f64(&o, "t", 0.0, 2.0).unwrap_err().param.as_deref(), Some("t"));
        assert!(opt_str(&o, "t").is_err());
        assert_eq!(opt_str(&o, "s").unwrap(), Some("x"));
        assert!(opt_int(&o, "n", 0, 10).is_err());
        assert!(opt_int(&o, "big", 0, i64::MAX).is_err());
        assert_eq!(opt_int(&o, "z", 0, 1).unwrap(), None);
        assert_eq!(opt_seed(&o, "neg").unwrap(), Some(-3i64 as u64));
        assert_eq!(stop_list(&o, "stop").unwrap_err().param.as_deref(), Some("stop"));
        assert_eq!(stop_list(&obj(json!({"stop": "x"})), "stop").unwrap(), vec!["x".to_string()]);
    }
}
