output "checkpoint_uri_prefix" {
  description = "Prefix of the run URIs for the training config's cloudckpt.uri."
  value       = module.checkpoints.checkpoint_uri_prefix
}

output "irsa_role_arn" {
  description = "For deploy/k8s/overlays/eks/serviceaccount-irsa.yaml (eks.amazonaws.com/role-arn)."
  value       = module.checkpoints.irsa_role_arn
}

output "policy_json" {
  description = "The least-privilege policy the role has."
  value       = module.checkpoints.policy_json
}
