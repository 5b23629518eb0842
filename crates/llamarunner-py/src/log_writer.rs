//! Where log lines go: stderr, one `write` per line. On a terminal each line first clears the
//! current one, where `llamarunner serve` draws its load progress bar (it draws the bar again
//! on its next poll), so a log line never lands in the middle of the bar; elsewhere (a pipe, a
//! file) lines are written as they are, without control characters.

use std::io::{IsTerminal, Write};

use tracing_subscriber::fmt::MakeWriter;

/// Clears the terminal line the cursor is on: carriage return, erase to the end of the line.
const CLEAR_LINE: &[u8] = b"\r\x1b[K";

/// Makes one `LineWriter` per log event.
#[derive(Debug)]
pub struct StderrLines {
    terminal: bool,
}

impl StderrLines {
    /// Writes to this process's stderr, clearing the line first when it is a terminal.
    pub fn new() -> Self {
        Self {
            terminal: std::io::stderr().is_terminal(),
        }
    }
}

impl<'a> MakeWriter<'a> for StderrLines {
    type Writer = LineWriter;

    fn make_writer(&'a self) -> LineWriter {
        LineWriter {
            terminal: self.terminal,
            line: Vec::new(),
        }
    }
}

/// One log event, collected and written to stderr in one call when dropped.
#[derive(Debug)]
pub struct LineWriter {
    terminal: bool,
    line: Vec<u8>,
}

impl Write for LineWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.line.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Drop for LineWriter {
    fn drop(&mut self) {
        if self.line.is_empty() {
            return;
        }
        let mut out = Vec::with_capacity(self.line.len() + CLEAR_LINE.len());
        if self.terminal {
            out.extend_from_slice(CLEAR_LINE);
        }
        out.extend_from_slice(&self.line);
        // Nowhere to report a failure to log.
        let _ = std::io::stderr().lock().write_all(&out);
    }
}
