//! Placeholder written by the lead so the workspace builds; the API helper replaces this file.
