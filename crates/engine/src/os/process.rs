//! Whether another process is still running (the prompt-state store's temporary files name
//! their writer's process id): `/proc` on Linux; elsewhere unknown, and callers fall back on age.

/// `Some(alive)` where the system tells cheaply, else `None`.
pub fn alive(pid: u32) -> Option<bool> {
    #[cfg(target_os = "linux")]
    {
        Some(std::path::Path::new("/proc").join(pid.to_string()).exists())
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = pid;
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_is_alive_and_a_finished_one_is_not() {
        if !cfg!(target_os = "linux") {
            assert_eq!(alive(std::process::id()), None);
            println!("SKIPPED: process liveness is only known on Linux");
            return;
        }
        assert_eq!(alive(std::process::id()), Some(true));
        let mut child = std::process::Command::new("true").spawn().expect("spawn true");
        let pid = child.id();
        child.wait().expect("wait");
        // Reaped: its id is free (reuse within this test is vanishingly unlikely).
        assert_eq!(alive(pid), Some(false));
    }
}
