//! `inplace-agent drift`: whether the node still matches the last plan that succeeded on it,
//! as the local agent last checked (its status socket), each drifted change with what
//! differs. Exit 0 when the node matches, 1 when it has drifted or no agent answers.
