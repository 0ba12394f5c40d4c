//! Built-in tools of the multi-turn RL loop (issue 36, `[rl.env] kind =
//! "tools"`) and the tool-call format they are called in: Hermes/Qwen's
//! `<tool_call>{"name": …, "arguments": {…}}</tool_call>`, one JSON object
//! per tag, as Qwen2.5/Qwen3 chat templates render an assistant's tool
//! calls. Pure: a policy turn's text in, the results out.
//!
//! A malformed call is the policy's mistake, not the job's: its result is
//! an error message the policy reads in the next turn (as the tool-calling
//! loops of verl and TRL answer it), never a job failure.

use serde_json::Value as Json;

pub const CALL_OPEN: &str = "<tool_call>";
pub const CALL_CLOSE: &str = "</tool_call>";

/// One call the policy made.
#[derive(Debug, Clone, PartialEq)]
pub enum Call {
    /// A well-formed call.
    Tool { name: String, arguments: Json },
    /// A `<tool_call>` block that is not one: why.
    Malformed(String),
}

/// The tool calls in a policy turn, in order (none: the turn answers).
pub fn parse_calls(text: &str) -> Vec<Call> {
    let mut calls = Vec::new();
    let mut rest = text;
    while let Some(at) = rest.find(CALL_OPEN) {
        let body = &rest[at + CALL_OPEN.len()..];
        let Some(end) = body.find(CALL_CLOSE) else {
            calls.push(Call::Malformed(format!("{CALL_OPEN} without {CALL_CLOSE}")));
            break;
        };
        calls.push(parse_one(body[..end].trim()));
        rest = &body[end + CALL_CLOSE.len()..];
    }
    calls
}

fn parse_one(body: &str) -> Call {
    let v: Json = match serde_json::from_str(body) {
        Ok(v) => v,
        Err(e) => return Call::Malformed(format!("the call is not JSON ({e})")),
    };
    let Some(name) = v.get("name").and_then(Json::as_str) else {
        return Call::Malformed("the call has no \"name\" string".into());
    };
    let arguments = match v.get("arguments") {
        None => Json::Object(Default::default()),
        // Some models write the arguments as a JSON string.
        Some(Json::String(s)) => match serde_json::from_str(s) {
            Ok(a) => a,
            Err(e) => return Call::Malformed(format!("\"arguments\" is not JSON ({e})")),
        },
        Some(a) => a.clone(),
    };
    Call::Tool {
        name: name.to_string(),
        arguments,
    }
}

/// The definitions of the tools `enabled`, as chat templates render
/// them (`apply_chat_template(tools=…)`: OpenAI's function format).
pub fn definitions(enabled: &[String]) -> Json {
    Json::Array(
        enabled
            .iter()
            .filter_map(|t| match t.as_str() {
                "calculator" => Some(serde_json::json!({
                    "type": "function",
                    "function": {
                        "name": "calculator",
                        "description": "Evaluates an arithmetic expression: numbers, + - * / ** and parentheses.",
                        "parameters": {
                            "type": "object",
                            "properties": {
                                "expression": {"type": "string", "description": "The expression, e.g. \"(12+3)*4\"."}
                            },
                            "required": ["expression"]
                        }
                    }
                })),
                _ => None,
            })
            .collect(),
    )
}

/// Runs one call with the tools `enabled`: the text its result message
/// carries (an error message when the call cannot be answered).
pub fn run(call: &Call, enabled: &[String]) -> String {
    match call {
        Call::Malformed(why) => format!("error: {why}"),
        Call::Tool { name, .. } if !enabled.iter().any(|t| t == name) => format!(
            "error: no tool named {name:?} (tools: {})",
            enabled.join(", ")
        ),
        Call::Tool { name, arguments } => match name.as_str() {
            "calculator" => match arguments.get("expression").and_then(Json::as_str) {
                Some(e) => calculate(e).unwrap_or_else(|why| format!("error: {why}")),
                None => "error: calculator takes {\"expression\": string}".into(),
            },
            other => format!("error: no tool named {other:?}"),
        },
    }
}

/// Longest expression the calculator reads.
const MAX_EXPRESSION: usize = 256;
/// Deepest nesting of parentheses and unary signs.
const MAX_DEPTH: usize = 32;

/// Evaluates an arithmetic expression: decimal numbers, `+ - * /`,
/// `**` or `^` (power), parentheses and unary signs. Integral results
/// print without a fraction (exactly, up to 2^53); others with up to 12
/// significant digits.
pub fn calculate(expr: &str) -> Result<String, String> {
    if expr.len() > MAX_EXPRESSION {
        return Err(format!(
            "expression longer than {MAX_EXPRESSION} characters"
        ));
    }
    let mut p = Parser {
        s: expr.as_bytes(),
        at: 0,
        depth: 0,
    };
    let v = p.sum()?;
    p.space();
    if p.at != p.s.len() {
        return Err(format!("unexpected {:?} at {}", p.s[p.at] as char, p.at));
    }
    if !v.is_finite() {
        return Err("the result is not a finite number".into());
    }
    Ok(format_number(v))
}

fn format_number(v: f64) -> String {
    if v.fract() == 0.0 && v.abs() < 9_007_199_254_740_992.0 {
        return format!("{}", v as i64);
    }
    let s = format!("{v:.11e}");
    let x: f64 = s.parse().unwrap_or(v);
    // Shortest text that reads back as the 12-digit rounding.
    format!("{x}")
}

struct Parser<'a> {
    s: &'a [u8],
    at: usize,
    depth: usize,
}

impl Parser<'_> {
    fn space(&mut self) {
        while self.at < self.s.len() && self.s[self.at].is_ascii_whitespace() {
            self.at += 1;
        }
    }

    fn eat(&mut self, tok: &str) -> bool {
        self.space();
        if self.s[self.at..].starts_with(tok.as_bytes()) {
            self.at += tok.len();
            true
        } else {
            false
        }
    }

    fn sum(&mut self) -> Result<f64, String> {
        let mut v = self.product()?;
        loop {
            if self.eat("+") {
                v += self.product()?;
            } else if self.eat("-") {
                v -= self.product()?;
            } else {
                return Ok(v);
            }
        }
    }

    fn product(&mut self) -> Result<f64, String> {
        let mut v = self.power()?;
        loop {
            self.space();
            if self.s[self.at..].starts_with(b"**") {
                return Ok(v);
            }
            if self.eat("*") {
                v *= self.power()?;
            } else if self.eat("/") {
                let d = self.power()?;
                if d == 0.0 {
                    return Err("division by zero".into());
                }
                v /= d;
            } else {
                return Ok(v);
            }
        }
    }

    /// Right-associative, binding tighter than a unary sign on its left
    /// (`-2^2` = -4, as Python's `-2**2`).
    fn power(&mut self) -> Result<f64, String> {
        let base = self.unary()?;
        if self.eat("**") || self.eat("^") {
            let e = self.power()?;
            return Ok(base.powf(e));
        }
        Ok(base)
    }

    fn unary(&mut self) -> Result<f64, String> {
        self.deeper()?;
        let v = if self.eat("-") {
            -self.power()?
        } else if self.eat("+") {
            self.power()?
        } else {
            self.atom()?
        };
        self.depth -= 1;
        Ok(v)
    }

    fn deeper(&mut self) -> Result<(), String> {
        self.depth += 1;
        if self.depth > MAX_DEPTH {
            return Err(format!("nested deeper than {MAX_DEPTH}"));
        }
        Ok(())
    }

    fn atom(&mut self) -> Result<f64, String> {
        if self.eat("(") {
            let v = self.sum()?;
            if !self.eat(")") {
                return Err(format!("missing ')' at {}", self.at));
            }
            return Ok(v);
        }
        self.space();
        let start = self.at;
        while self.at < self.s.len()
            && (self.s[self.at].is_ascii_digit() || self.s[self.at] == b'.')
        {
            self.at += 1;
        }
        if start == self.at {
            return Err(match self.s.get(self.at) {
                Some(&c) => format!("unexpected {:?} at {}", c as char, self.at),
                None => "the expression ends too early".into(),
            });
        }
        let text = std::str::from_utf8(&self.s[start..self.at]).expect("ASCII digits");
        text.parse::<f64>()
            .map_err(|_| format!("{text:?} is not a number"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calls_parse_in_order_and_garbage_is_named() {
        let t = "let me see <tool_call>{\"name\": \"calculator\", \"arguments\": {\"expression\": \"12*34\"}}</tool_call> and\n<tool_call>\n{\"name\":\"calculator\",\"arguments\":\"{\\\"expression\\\": \\\"1+1\\\"}\"}\n</tool_call><tool_call>{oops</tool_call><tool_call>{\"name\":1}</tool_call><tool_call>{\"name\":\"x\"}";
        let calls = parse_calls(t);
        assert_eq!(calls.len(), 5);
        assert_eq!(
            calls[0],
            Call::Tool {
                name: "calculator".into(),
                arguments: serde_json::json!({"expression": "12*34"})
            }
        );
        assert_eq!(
            calls[1],
            Call::Tool {
                name: "calculator".into(),
                arguments: serde_json::json!({"expression": "1+1"})
            }
        );
        assert!(matches!(&calls[2], Call::Malformed(w) if w.starts_with("the call is not JSON")));
        assert!(matches!(&calls[3], Call::Malformed(w) if w.contains("\"name\"")));
        assert!(matches!(&calls[4], Call::Malformed(w) if w.contains("without")));
        assert!(parse_calls("42").is_empty());
        let tools = vec!["calculator".to_string()];
        assert_eq!(run(&calls[0], &tools), "408");
        assert_eq!(run(&calls[1], &tools), "2");
        assert!(run(&calls[2], &tools).starts_with("error: the call is not JSON"));
        let other = Call::Tool {
            name: "search".into(),
            arguments: Json::Null,
        };
        assert_eq!(
            run(&other, &tools),
            "error: no tool named \"search\" (tools: calculator)"
        );
        let defs = definitions(&tools);
        assert_eq!(defs[0]["function"]["name"], "calculator");
        assert_eq!(
            defs[0]["function"]["parameters"]["required"][0],
            "expression"
        );
    }

    #[test]
    fn the_calculator_follows_python_precedence_and_refuses_what_it_cannot_read() {
        for (e, want) in [
            ("123456 * 789", "97406784"),
            ("1 + 2 * 3", "7"),
            ("(1 + 2) * 3", "9"),
            ("2 ** 3 ** 2", "512"),
            ("-2^2", "-4"),
            ("7 / 2", "3.5"),
            ("1/3", "0.333333333333"),
            (" 10 - 4 - 3 ", "3"),
            ("2.5*4", "10"),
        ] {
            assert_eq!(calculate(e).as_deref(), Ok(want), "{e}");
        }
        assert_eq!(calculate("1/0"), Err("division by zero".into()));
        assert_eq!(
            calculate("2 +"),
            Err("the expression ends too early".into())
        );
        assert_eq!(calculate("2 $ 3"), Err("unexpected '$' at 2".into()));
        assert_eq!(calculate("(1"), Err("missing ')' at 2".into()));
        assert!(calculate(&"(".repeat(40)).unwrap_err().contains("nested"));
        assert!(calculate(&"1+".repeat(200)).unwrap_err().contains("longer"));
        assert!(calculate("10**400").unwrap_err().contains("finite"));
        assert!(calculate("1.2.3").unwrap_err().contains("not a number"));
    }
}
