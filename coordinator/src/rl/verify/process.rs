//! The `command` verifier's program as a process group: it and whatever it
//! starts share a group of their own, so one signal ends them all (a
//! grandchild that holds the output pipe open, or lingers after the batch,
//! included). Unix only; elsewhere the program alone is killed.

use std::io;
use std::process::{Child, Command, ExitStatus};

/// The program runs in a new process group, its id the program's pid.
pub fn isolate(cmd: &mut Command) {
    #[cfg(unix)]
    std::os::unix::process::CommandExt::process_group(cmd, 0);
    #[cfg(not(unix))]
    let _ = cmd;
}

/// A spawned program: its group is killed and the program reaped however
/// the batch ends, early returns and panics included.
pub struct Group {
    child: Option<Child>,
}

impl Group {
    pub fn new(child: Child) -> Group {
        Group { child: Some(child) }
    }

    /// Whether the program has exited. Leaves it unreaped on unix: while
    /// it is a zombie its pid, the group's id, cannot be reused, so the
    /// kill in [`Group::end`] cannot reach another process's group.
    pub fn exited(&mut self) -> io::Result<bool> {
        let child = self.child.as_mut().expect("running until end");
        #[cfg(unix)]
        {
            use rustix::process::{waitid, Pid, WaitId, WaitIdOptions};
            let pid = Pid::from_child(child);
            let opts = WaitIdOptions::EXITED | WaitIdOptions::NOHANG | WaitIdOptions::NOWAIT;
            Ok(waitid(WaitId::Pid(pid), opts)?.is_some())
        }
        #[cfg(not(unix))]
        Ok(child.try_wait()?.is_some())
    }

    /// Kills the whole group (what is left of it) and reaps the program:
    /// its exit status, or the kill's when it was still running.
    pub fn end(mut self) -> io::Result<ExitStatus> {
        let mut child = self.child.take().expect("ended once");
        kill(&mut child);
        child.wait()
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            kill(&mut child);
            let _ = child.wait();
        }
    }
}

/// SIGKILL to the program's group; nothing left in it is no error.
fn kill(child: &mut Child) {
    #[cfg(unix)]
    {
        use rustix::process::{kill_process_group, Pid, Signal};
        let _ = kill_process_group(Pid::from_child(child), Signal::KILL);
    }
    #[cfg(not(unix))]
    let _ = child.kill();
}
