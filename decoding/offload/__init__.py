"""Edge–cloud verification, the home's half: which drafted chunks a cloud verifier sees, and the
loop that drafts, offloads and keeps drafting while a verification is in flight."""
